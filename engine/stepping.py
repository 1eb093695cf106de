"""The step loop: schedule a batch, run it, sample, and turn tokens into outputs.

``StepLoop`` owns the live requests (``seqs``) and the engine-wide counters. Each ``step`` packs
one forward pass through the Scheduler, runs it on the ModelRunner, samples, checks stop
conditions, and finishes requests: a one-shot request's cache is released, a session's turn ends
in its chain (ChainCache.finish_turn / abort_turn / fail_turn).

In steady greedy decoding on the GPU the loop runs one step ahead: it launches step t, then reads
and processes the tokens of step t-1 while the GPU works (their outputs arrive one call later).
Any other step first completes the step in flight.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Hashable

from engine.recall_step import RecallStep
from engine.chain import ChainCache
from engine.config import EngineConfig
from engine.penalties import apply_penalties, uses_penalty
from engine.runner import InFlight, ModelRunner
from engine.sampling import sample
from engine.scheduler import Scheduler
from engine.sequence import PENDING, RequestOutput, Sequence, SeqStatus

log = logging.getLogger(__name__)

MAX_FAILED_PASSES = 3
"""Forward passes in a row that may raise (their requests fail, the engine steps on) before the error
stops the engine: a device that fails every pass is broken, and a supervisor should restart the server."""


class StepLoop:
    def __init__(
        self,
        config: EngineConfig,
        scheduler: Scheduler,
        runner: ModelRunner,
        chains: ChainCache,
        tokenizer: Any,
        eos_token_ids: set[int],
        max_model_len: int,
    ):
        self.config = config
        self.scheduler = scheduler
        self.runner = runner
        self.chains = chains
        self.recall = RecallStep(runner)
        self.manager = scheduler.manager
        self.controller = scheduler.controller
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.seqs: dict[Hashable, Sequence] = {}
        """Live requests by id (a session's Sequence while its turn runs)."""
        self.inflight: InFlight | None = None
        """A launched decode step whose tokens are not read yet."""
        self.grammar_masks = None
        """Structured output: ``(logits, matchers) -> None`` masking the constrained rows (set by the engine)."""
        self.failed_passes = 0
        """Forward passes in a row that raised (``MAX_FAILED_PASSES``)."""
        self.totals = {
            "decoded_tokens": 0,
            "finished_stop": 0,
            "finished_length": 0,
            "finished_abort": 0,
            "finished_error": 0,
            "finished_failed": 0,
        }
        """Engine-wide counters since start."""

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or self.inflight is not None

    def step(self) -> list[RequestOutput]:
        """Run one forward pass; outputs for every request that produced tokens or finished."""
        touched: list[Sequence] = []
        overlap = self._overlap_ok()
        if not overlap and self.inflight is not None:
            touched += self._complete(self.inflight)
            self.inflight = None
        t0 = time.monotonic()
        batch = self.scheduler.schedule()
        for seq, reason in batch.failed:
            seq.error = reason
            self.finish(seq, "error")
            touched.append(seq)
        if overlap and not batch.empty and self.runner.graph_ok(batch, None):
            previous, self.inflight = self.inflight, None
            try:
                launched = self.runner.launch_decode(batch, previous)
            except Exception as e:  # as below: the pass's requests fail; the step before it completes
                if previous is not None:
                    touched += self._complete(previous)
                touched += self._fail_pass(batch.decode, e)
                return [self.output(s) for s in touched]
            self.failed_passes = 0
            for seq in batch.decode:
                seq.token_ids.append(PENDING)  # its value arrives when this step completes
            self.inflight = launched
            if previous is not None:
                touched += self._complete(previous)
            _charge(batch, time.monotonic() - t0, {})
            return [self.output(s) for s in touched]
        if self.inflight is not None:  # the batch needs the tokens still in flight
            touched += self._complete(self.inflight)
            self.inflight = None
            batch.decode = [s for s in batch.decode if not s.finished]
        if not batch.empty:
            starts = {id(s): s.num_cached for s, _ in batch.prefill}
            try:
                result = self._forward(batch)
            except Exception as e:  # the pass's requests fail; _fail_pass re-raises when it is fatal
                touched += self._fail_pass(_seqs_of(batch), e)
                self.scheduler.swap_in(batch)
                return [self.output(s) for s in touched]
            self.failed_passes = 0
            for sid, rows in result.prompt_logits.items():
                self.seqs[sid].prompt_logits.append(rows.cpu())
            matchers = [s.matcher for s in result.sampling]
            constrain = None
            if self.grammar_masks is not None and any(m is not None for m in matchers):
                constrain = lambda logits: self.grammar_masks(logits, matchers)  # noqa: E731
            apply_penalties(result.logits, result.sampling)  # before the grammar masks
            tokens, errors = sample(
                result.logits, [s.params for s in result.sampling], [s.generator for s in result.sampling], constrain
            )
            now = time.monotonic()
            _charge(batch, now - t0, starts)
            for seq, tok, err, row in zip(result.sampling, tokens, errors, result.logits):
                touched.append(seq)
                if err is None:
                    try:
                        if seq.params.return_logits:
                            seq.step_logits.append(row.cpu())
                        self._append_token(seq, tok, now)
                        continue
                    except Exception as e:  # detokenizing or stop checks of this sequence
                        err = f"processing the sampled token failed: {e!r}"
                if not seq.finished:  # this request alone fails; the engine steps on for the others
                    log.error("request %r failed: %s", seq.seq_id, err)
                    seq.error = err
                    self.finish(seq, "failed")
        self.scheduler.swap_in(batch)  # after the pass: the step's requests did not wait for the copies
        self.prefetch(limit=1)  # one copy a step at most: the next step waits for it
        return [self.output(s) for s in touched]

    def prefetch(self, limit: int | None) -> int:
        """Bring sessions in host memory whose agents are due back onto the GPU (at most ``limit``),
        into the pages and cache slots no admitted or waiting request may need (``spare_room``); never
        while a step is in flight (as ``swap_in``, restores run between passes)."""
        tiers = self.chains.tiers
        if self.inflight is not None or not tiers.prefetch_due():
            return 0
        pages, slots = self.scheduler.spare_room()
        return tiers.prefetch(pages, slots, limit)

    def _forward(self, batch):
        """The forward pass of ``batch`` and what follows it before sampling (prefix holders, scoring)."""
        chains = self.chains.chains
        prefilling = {s.seq_id for s, _ in batch.prefill}
        windows = {
            s.seq_id: c.queries
            for s in _seqs_of(batch)
            if (c := chains.get(s.seq_id)) and c.queries and (c.queries.decode or s.seq_id in prefilling)
        }
        result = self.runner.execute(batch, windows)
        for seq in _seqs_of(batch):
            if seq.prefix_boundary:
                self.chains.after_step(seq)
        for seq, _ in batch.prefill:  # after the prefix holders: they keep the whole prefix
            if seq.num_cached == seq.num_tokens:  # the turn's input is in: a method may score it
                self.runner.scoring_pass(seq, self.tokenizer, self.config.prefill_chunk_size)
        self.recall.after_pass(batch, result, windows)  # after the methods' own compression
        return result

    def _fail_pass(self, seqs: list[Sequence], error: Exception) -> list[Sequence]:
        """A forward pass raised (out of memory, a kernel's error; on the run-ahead path too, or when
        its tokens are read): every request in it (``seqs``) fails, its turn rolled back, and the engine
        steps on for the others. Re-raised (the engine stops) when the passes keep failing
        (``MAX_FAILED_PASSES``) or when this engine is one rank of a tensor-parallel group, whose other
        ranks are inside the same pass (the group must go down together)."""
        from engine.distributed import group

        self.failed_passes += 1
        if group.active() or self.failed_passes >= MAX_FAILED_PASSES:
            raise error
        seqs = [s for s in seqs if not s.finished]
        log.error(
            "a forward pass failed (%d in a row): failing its %d request(s): %r", self.failed_passes, len(seqs), error
        )
        for seq in seqs:
            seq.error = f"the forward pass failed: {error!r}"
            self.finish(seq, "failed")
        return seqs

    def _overlap_ok(self) -> bool:
        """Can the next step run ahead of its predecessor's tokens? Steady greedy decoding only, without
        grammars or penalties (both need the previous token on the host before the next row is sampled)."""
        if self.runner.graphs is None or not self.config.async_decode:
            return False
        s = self.scheduler
        if s.waiting or not s.running:
            return False
        chains = self.chains.chains
        return all(
            q.in_decode
            and q.params.greedy
            and not q.params.return_logits
            and q.matcher is None
            and not uses_penalty(q.params)
            and not (q.seq_id in chains and chains[q.seq_id].queries is not None and chains[q.seq_id].queries.decode)
            for q in s.running
        )

    def _complete(self, inflight: InFlight) -> list[Sequence]:
        """Wait for a launched step's tokens and take them in (stop checks, text, outputs)."""
        try:
            tokens = inflight.read()  # waits for that step only, not for the one launched after it
        except Exception as e:  # the launched step failed on the device (an error surfacing late)
            current = [s for s, serial in zip(inflight.seqs, inflight.serials) if s.turn_serial == serial]
            return self._fail_pass(current, e)
        now = time.monotonic()
        done = []
        for seq, serial, at, tok in zip(inflight.seqs, inflight.serials, inflight.slots, tokens):
            if seq.finished or seq.turn_serial != serial or at >= len(seq.token_ids) or seq.token_ids[at] != PENDING:
                continue  # it finished (or was restarted) meanwhile: this token is past its end
            self._append_token(seq, tok, now, at=at)
            done.append(seq)
        return done

    def _append_token(self, seq: Sequence, token: int, now: float, at: int | None = None) -> None:
        if seq.first_token_time is None:
            seq.first_token_time = seq.timing.first_token_at = now
        if at is None:
            seq.token_ids.append(token)
        else:
            seq.token_ids[at] = token
        seq.output_ids.append(token)
        seq.pending_ids.append(token)
        seq.in_decode = True
        seq.counters.decoded_tokens += 1
        self.totals["decoded_tokens"] += 1
        p = seq.params
        is_stop = token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)
        grammar_done = False
        if seq.matcher is not None:
            seq.matcher.advance(token)
            grammar_done = seq.matcher.done  # the structure is complete: nothing may follow it
        if not is_stop:
            seq.pending_text += seq.detok.push(token)
        if is_stop or grammar_done or seq.detok.stopped_on is not None:
            self.finish(seq, "stop")
        elif len(seq.output_ids) >= p.max_tokens or len(seq.output_ids) + seq.prompt_len >= self.max_model_len:
            self.finish(seq, "length")

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a request (``stop``, ``length``, ``abort`` or ``error``): a session's turn ends in its
        chain, a one-shot request's cache is released."""
        while seq.token_ids and seq.token_ids[-1] == PENDING:  # a step launched past the end
            seq.token_ids.pop()
        seq.num_cached = min(seq.num_cached, len(seq.token_ids))
        seq.pending_text += seq.detok.flush()
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.timing.finished_at = time.monotonic()
        seq.penalty_state = None  # a session's sequence outlives its turn: free the penalty counts
        self.totals[f"finished_{reason}"] += 1
        self.scheduler.remove(seq)
        if seq.seq_id in self.chains.chains:  # a session keeps its chain
            if reason in ("abort", "failed"):  # failed: this request alone broke; the turn is rolled back
                self.chains.abort_turn(seq)
            elif reason == "error":
                self.chains.fail_turn(seq)
            else:
                self.chains.finish_turn(seq)
            return
        if self.manager.has(seq.seq_id):
            self.manager.release(seq.seq_id)
        self.controller.release(seq.seq_id)

    def output(self, seq: Sequence) -> RequestOutput:
        """The request's output since the last one (a finished request leaves ``seqs``)."""
        out = RequestOutput(
            request_id=seq.seq_id,
            prompt_token_ids=seq.token_ids[: seq.prompt_len] if seq.finished else [],
            token_ids=seq.output_ids,
            text=seq.detok.text,
            new_token_ids=seq.pending_ids,
            new_text=seq.pending_text,
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            error=seq.error,
            counters=seq.counters,
            source_tier=None if seq.source_tier is None else seq.source_tier.value,
            turn_start=seq.turn_start,
            time_to_first_token=None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time,
            timing=seq.timing if seq.finished else None,
        )
        seq.pending_ids, seq.pending_text = [], ""
        if seq.finished:
            self.seqs.pop(seq.seq_id, None)
        return out


def _charge(batch, seconds: float, starts: dict[int, int]) -> None:
    """Charge a step's wall time to the timing of each request in it (engine/turn_timing.py):
    prefill (history lost and fed again: recompute), decode, and the share of a decode step that the
    prefill chunks sharing it took. ``starts``: each prefilling sequence's cached length before the step."""
    prefill_tokens = sum(n for _, n in batch.prefill)
    total = prefill_tokens + len(batch.decode)
    if total == 0:
        return
    share = prefill_tokens / total
    for seq in batch.decode:
        seq.timing.decode_step(seconds, share)
    for seq, n in batch.prefill:
        start = starts.get(id(seq), seq.num_cached)
        lost = (
            seq.turn_start - 1
        )  # the history before the turn, less its last token (never fed: the next turn feeds it)
        recompute = max(0, min(lost, start + n) - start)
        seq.timing.prefill_step(seconds, n, recompute)


def _seqs_of(batch) -> list[Sequence]:
    return list(batch.decode) + [s for s, _ in batch.prefill]
