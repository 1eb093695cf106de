"""When the recall tier acts in the step loop: once a turn's input is in, and every N decode steps.

The StepLoop calls ``after_pass`` after each forward pass (engine/stepping.py). For a sequence of a
``<method>+recall`` method (engine/methods/recall_variant.py) it takes the latest queries of the
sequence's query window and has the controller recall what they attend to (engine/recall.py):

* when the pass completed a turn's input (after the method's own compression and scoring pass).
  The reply's first token was sampled from logits computed before the recall, so the input's last
  token is run again (its KV truncated, then prefilled alone, with no method hook seeing it) and
  its new logits replace the pass's;
* during decoding, every ``recall_interval`` tokens, if set (no run again: the next step reads it).

Before any of that, every pass, the cold tier's copies to the host that have run are handed on to
be written into their stores (``RecallTier.poll``, which never waits: engine/cache/cold_copy.py).
"""

from __future__ import annotations

import logging

import torch

from engine.attention.paged import PagedAttention, PrefillSegment
from engine.cache.transfer import to_device

log = logging.getLogger(__name__)


class RecallStep:
    def __init__(self, runner):
        self.runner = runner
        self.controller = runner.controller
        self.manager = runner.manager
        self.reruns = 0

    @torch.inference_mode()  # like the pass itself (the logits it replaces are inference tensors)
    def after_pass(self, batch, result, windows: dict) -> None:
        """Recall for the sequences of the pass just run (``result.logits`` rows may be replaced)."""
        self.controller.recall.poll()  # copies to the cold tier that have run land in their stores
        for seq, _ in batch.prefill:
            if seq.num_cached == seq.num_tokens and not seq.finished:
                settings = self.controller.recall_settings(seq.seq_id)
                if settings is not None and self._recall(seq, windows, True) and settings.recall_rerun:
                    self._rerun(seq, result)
        for seq in batch.decode:
            settings = self.controller.recall_settings(seq.seq_id)
            if settings is not None and settings.recall_interval and seq.num_cached % settings.recall_interval == 0:
                self._recall(seq, windows, False)

    def _recall(self, seq, windows: dict, at_input: bool) -> bool:
        window = windows.get(seq.seq_id)
        if window is None or window.q is None or not window.count or min(window.count) == 0:
            return False
        n = min(min(window.count), window.size)
        result = self.controller.recall_now(seq.seq_id, seq.num_cached, window.q[:, :n], at_input)
        return result.recalled > 0

    def _rerun(self, seq, result) -> None:
        """Run the input's last token again so the first reply token reads the recalled KV."""
        m, sid, n = self.manager, seq.seq_id, seq.num_cached
        P, s = m.page_size, m.slot(seq.seq_id)
        lengths = m.lengths[s].long()
        last = (lengths - 1).clamp(min=0)
        page = m.tables[s].long().gather(-1, (last // P)[..., None]).squeeze(-1)
        pos_last = m.pool.pos.view(-1)[to_device(page.clamp(min=0) * P + last % P, m.device)].cpu()
        if bool((lengths < 1).any()) or bool((page < 0).any()) or bool((pos_last != n - 1).any()):
            log.info("recall of %r: the last input token is not every head's last; not run again", sid)
            return
        m.truncate(sid, lengths - 1)
        pos = torch.tensor([n - 1])
        slot_mapping = m.append([sid], [1], pos)
        seg = PrefillSegment(seq_id=sid, slot=s, offset=0, length=1, start=n - 1, is_last=True, hooks=False)
        r = self.runner
        pos_dev = to_device(pos, r.device)
        attend = PagedAttention(m, self.controller, r.backend, r.scale, [], [], [seg], slot_mapping, pos_dev)
        ids = torch.tensor([seq.token_ids[n - 1]], dtype=torch.long, device=r.device)
        logits = r.model(ids, pos_dev, attend, torch.tensor([0], device=r.device))
        r.forward_passes += 1
        self.reruns += 1
        for i, other in enumerate(result.sampling):
            if other is seq:
                result.logits[i] = logits[0].to(result.logits.dtype)
