"""The order in which a compaction (engine/cache/compaction.py) carries out its rows, decided on the host
before anything changes: chunks of rows under a byte budget, rows that write pages a fork shares
grouped with the rows they share those pages with, and the plan's page accounting replayed so that a
compaction short of copy-on-write pages is refused whole.

Why rows that share pages may move in separate chunks at all. A chunk (``compaction._move``) gathers
every token its rows move before it frees or writes any page, and it writes a page in place only
when the writing row is the page's one holder (reference count 1); otherwise the row writes a fresh
copy. Every other holder of that page has therefore either released it, which it does in its own
chunk after its own gather, or never held it. A fresh page had no holder. So no row ever reads a
token another row wrote, whatever the order of the chunks: each row's kept tokens are the same.

What the order changes is only the page accounting. A page that one row writes and another row of
the same compaction releases (its freed tail, a fork's twin) is written in place when the release
comes first and copied when it comes after. Either way each writer ends with a page of its own and
the page stays only while a holder outside the writers keeps it, so the pages' sharing structure and
the free count come out the same; the copy costs a page copy and needs a free page at that moment.
Hence:

* rows linked through a page that one of them writes while another holds it (connected components
  over such pages) stay in one chunk where the component fits the budget: exactly the decisions of
  moving every sharing row at once, and no extra copies;
* a component larger than the budget (a batch of forks of one prompt whose sink pages every row
  rewrites) moves a chunk of rows at a time, safe by the argument above; staging its moved tokens
  through host memory instead would keep the all-at-once decisions but cost a device -> host ->
  device round trip of every moved token at each decode-time eviction;
* :func:`check_pages` replays the plan's releases and copies on a copy of the reference counts and
  raises ``OutOfPages`` before anything changes if some chunk would find too few free pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.cache.errors import OutOfPages
from engine.cache.transfer import ceil_div


@dataclass
class Rows:
    """Rows of one compaction (host int64 ``[n]`` each): the cache row, its length, its protected
    leading tokens and, once counted, its new length and its leading run."""

    slots: torch.Tensor
    layers: torch.Tensor
    heads: torch.Tensor
    old: torch.Tensor
    protect: torch.Tensor | None
    new: torch.Tensor | None = None
    lead: torch.Tensor | None = None

    def __getitem__(self, idx) -> "Rows":
        pick = lambda x: None if x is None else x[idx]  # noqa: E731
        return Rows(*(pick(getattr(self, f)) for f in ("slots", "layers", "heads", "old", "protect", "new", "lead")))


class RowPages:
    """The page lists of some rows (host) and which of their entries the compaction frees (``tail``:
    past the new end) and rewrites (``written``: from the leading run's page to the new end)."""

    def __init__(self, manager, rows: Rows):
        P = manager.page_size
        maxp = max(1, int(ceil_div(int(rows.old.max()), P)))
        self.table = manager.tables[rows.slots, rows.layers, rows.heads, :maxp].long()
        col = torch.arange(maxp)[None, :]
        new_np, old_np = ceil_div(rows.new, P)[:, None], ceil_div(rows.old, P)[:, None]
        self.held = self.table >= 0
        self.tail = (col >= new_np) & (col < old_np) & self.held
        self.written = (col >= (rows.lead // P)[:, None]) & (col < new_np) & self.held
        self.written_shared = self.written & (manager.pool.refcount[self.table.clamp(min=0)] > 1)


def chunks(costs: torch.Tensor, budget: int) -> list[tuple[int, int]]:
    """Consecutive spans ``[a, b)`` of rows whose ``costs`` (host) add up to at most ``budget``,
    at least one row each."""
    csum = costs.cumsum(0)
    out, a, base = [], 0, 0
    while a < len(costs):
        b = max(a + 1, int(torch.searchsorted(csum, base + budget, right=True)))
        out.append((a, b))
        base, a = int(csum[b - 1]), b
    return out


def sharing_groups(
    manager, rows: Rows, sharing: torch.Tensor, linked: torch.Tensor, row_cost: torch.Tensor, budget: int
) -> list[torch.Tensor]:
    """The rows ``sharing`` (indices into ``rows``, rows that write a page another owner reads) as
    chunks to move one after another: whole connected components over the ``linked`` pages (bool
    ``[num_pages]``: pages some sharing row writes) packed up to ``budget`` by ``row_cost`` (per
    sharing row), a component larger than the budget a chunk of its rows at a time."""
    n = int(sharing.numel())
    label = _components(manager, rows, sharing, linked, row_cost, budget)
    order = torch.argsort(label, stable=True)
    label, cost = label[order], row_cost[order]
    starts = torch.cat([torch.tensor([0]), (label[1:] != label[:-1]).nonzero().flatten() + 1, torch.tensor([n])])
    csum = torch.cat([torch.zeros(1, dtype=cost.dtype), cost.cumsum(0)])
    at_start = csum[starts]
    out, i = [], 0
    while i < len(starts) - 1:
        a, b = int(starts[i]), int(starts[i + 1])
        if int(csum[b] - csum[a]) > budget:  # one component past the budget: its rows a chunk at a time
            out += [order[a + x : a + y] for x, y in chunks(cost[a:b], budget)]
            i += 1
            continue
        j = int(torch.searchsorted(at_start, csum[a] + budget, right=True)) - 1  # whole components that fit
        out.append(order[a : int(starts[j])])
        i = j
    return [sharing[idx] for idx in out]


def _components(
    manager, rows: Rows, sharing: torch.Tensor, linked: torch.Tensor, row_cost: torch.Tensor, budget: int
) -> torch.Tensor:
    """Per sharing row, the lowest row index of its connected component: rows are connected when
    both hold a ``linked`` page (label propagation with pointer jumping over the row-page pairs)."""
    n = int(sharing.numel())
    er, ep = [], []
    for a, b in chunks(row_cost, budget):
        pages = RowPages(manager, rows[sharing[a:b]])
        hit = pages.held & linked[pages.table.clamp(min=0)]
        r, _ = hit.nonzero(as_tuple=True)
        er.append(r + a)
        ep.append(pages.table[hit])
    label = torch.arange(n)
    er, ep = torch.cat(er), torch.cat(ep)
    if er.numel() == 0:
        return label
    _, page_of = torch.unique(ep, return_inverse=True)
    m = int(page_of.max()) + 1
    while True:
        low = torch.full((m,), n).scatter_reduce(0, page_of, label[er], "amin")
        step = label.scatter_reduce(0, er, low[page_of], "amin")
        step = step[step]  # a label is a row of the same component with a lower index: jump along
        if torch.equal(step, label):
            return label
        label = step


def check_pages(manager, rows: Rows, plan: list[torch.Tensor]) -> None:
    """Raise ``OutOfPages`` if carrying out ``plan`` (chunks of row indices, in order) would at some
    chunk need more copy-on-write pages than are free then; changes nothing. Replays each chunk as
    ``compaction._move`` does: its tails released, then a fresh page for each page it writes that
    another owner still holds, then that page released."""
    pool = manager.pool
    ref, free = pool.refcount.clone(), pool.num_free

    def release(pages: torch.Tensor) -> int:
        if pages.numel() == 0:
            return 0
        ref.index_add_(0, pages, torch.full_like(pages, -1, dtype=ref.dtype))
        return int((ref[pages.unique()] == 0).sum())

    for idx in plan:
        pages = RowPages(manager, rows[idx])
        free += release(pages.table[pages.tail])
        copied = pages.written & (ref[pages.table.clamp(min=0)] > 1)
        need = int(copied.sum())
        if need > free:
            raise OutOfPages(f"compaction needs {need} copy-on-write pages at once, {free} free then")
        free += release(pages.table[copied]) - need
