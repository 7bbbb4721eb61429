"""What the scheduler hands the sampler for the penalties: the sequence's own tokens, only for
the requests that use one, right after a preemption and after an executor restart."""

from __future__ import annotations

from stoic.actors.testing import create_scheduler, next_letter
from stoic.request import SamplingParams, SeqChunk


def test_penalised_chunks_carry_the_tokens_generated_so_far_and_others_nothing() -> None:
    """Every sampling chunk of a request with a frequency penalty carries exactly the tokens it
    generated before it (none for the first), and no prompt; a request without penalties
    carries neither; chunks that do not sample carry neither."""
    h = create_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=8)
    h.add("x" * 11, params=SamplingParams(max_tokens=5, frequency_penalty=0.5), max_tokens=5)
    h.add("plain", max_tokens=5)
    seen: dict[int, list[SeqChunk]] = {0: [], 1: []}
    generated: dict[int, list[int]] = {0: [], 1: []}

    def record(chunk: SeqChunk) -> int:
        assert chunk.output_ids == (tuple(generated[0]) if chunk.seq_id == 0 else ())
        assert chunk.prompt_ids == ()
        seen[chunk.seq_id].append(chunk)
        token = next_letter(chunk)
        generated[chunk.seq_id].append(token)
        return token

    h.run_until_idle(sample=record)
    h.check()
    assert [len(c.output_ids) for c in seen[0]] == [0, 1, 2, 3, 4]
    unsampled = [c for b in h.batches for c in b.chunks if not c.sample]
    assert unsampled and all(c.output_ids == c.prompt_ids == () for c in unsampled)


def test_repetition_penalty_chunks_carry_the_prompt_too() -> None:
    """With ``repetition_penalty`` on, a sampling chunk also carries the whole prompt."""
    h = create_scheduler()
    h.add("abc", params=SamplingParams(max_tokens=3, repetition_penalty=1.2), max_tokens=3)
    h.run_until_idle()
    chunks = [c for b in h.batches for c in b.chunks]
    assert [c.prompt_ids for c in chunks] == [tuple(b"abc")] * 3
    assert [c.output_ids for c in chunks] == [(), (ord("d"),), (ord("d"), ord("e"))]


def test_the_tokens_survive_preemption_and_executor_restarts() -> None:
    """After a preemption (recomputed from the prompt) and after an executor failure with
    ``--recovery resume``, the next sampling chunk still carries every token generated before."""
    h = create_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, recovery="resume")
    penalised = SamplingParams(max_tokens=9, presence_penalty=1.0, repetition_penalty=1.1)
    h.add("a" * 7, max_tokens=9)
    h.add("b" * 7, params=penalised, max_tokens=9)
    h.step()
    while not h.core.waiting:
        h.step()
    assert [s.seq_id for s in h.core.waiting] == [1]
    before = tuple(h.core.waiting[0].output_ids)
    assert before  # it had generated tokens when it was preempted
    while h.core.waiting:
        h.step()
    resumed = next(c for c in h.batches[-1].chunks if c.seq_id == 1)
    assert resumed.sample and resumed.output_ids == before
    assert resumed.prompt_ids == tuple(b"b" * 7)
    seq = next(s for s in h.core.running if s.seq_id == 1)
    generated = tuple(seq.output_ids)
    h.start_step()
    h.executor_down()
    batch = h.step()
    assert batch is not None
    chunk = next(c for c in batch.chunks if c.seq_id == 1)
    assert chunk.sample and chunk.output_ids == generated
    h.run_until_idle()
    h.check()
