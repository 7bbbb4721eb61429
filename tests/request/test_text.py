"""The one text module: incremental detokenising, stop strings and prompt tokenisation.

A byte-level tokenizer (one token per UTF-8 byte) splits every multi-byte character across
tokens and lets a test feed a text in any split it likes.
"""

from __future__ import annotations

import pytest

from stoic.actors.testing import byte_tokenizer
from stoic.errors import InvalidRequest
from stoic.request import Detokenizer, Request, StopStrings, TokenCodec

BACKEND = byte_tokenizer()


def ids(text: str) -> list[int]:
    return list(text.encode())


def stream(text: str, *, chunk: int = 1, **kwargs: object) -> tuple[list[str], Detokenizer]:
    """Feed ``text``'s tokens ``chunk`` at a time, taking the text after each batch as a replica
    does (final once a stop string matched or the tokens ran out); the pieces the client got."""
    detok = Detokenizer(BACKEND, **kwargs)  # type: ignore[arg-type]
    tokens, pieces = ids(text), []
    for i in range(0, len(tokens), chunk):
        detok.add(tokens[i : i + chunk])
        last = i + chunk >= len(tokens)
        pieces.append(detok.take(final=last or detok.stop_matched is not None))
        if detok.stop_matched is not None:
            break
    return pieces, detok


@pytest.mark.parametrize("chunk", [1, 2, 3, 100])
def test_a_stop_string_split_across_tokens_cuts_where_it_begins(chunk: int) -> None:
    pieces, detok = stream("alpha STOP beta", chunk=chunk, stop=("STOP",))
    assert detok.stop_matched == "STOP"
    assert "".join(pieces) == detok.text == "alpha "


def test_only_a_tail_that_may_begin_a_stop_string_is_held_back() -> None:
    detok = Detokenizer(BACKEND, stop=("STOP",))
    detok.add(ids("say ST"))
    assert detok.take(final=False) == "say "  # "ST" may begin "STOP"
    detok.add(ids("AR"))
    assert detok.take(final=False) == "STAR"  # it cannot any more
    detok.add(ids("s S"))
    assert detok.take(final=False) == "s "
    assert detok.add(ids("TOP")) == "STOP"
    assert detok.take(final=False) == ""
    assert detok.text == "say STARs "


@pytest.mark.parametrize("chunk", [1, 2, 5, 100])
def test_the_stop_string_completed_first_wins_whatever_the_split(chunk: int) -> None:
    """A later stop string that ends earlier in the text wins over an earlier listed one that
    begins earlier: a text arriving in one token cuts where one arriving byte by byte does."""
    pieces, detok = stream("xabcdy", chunk=chunk, stop=("abcd", "bc"))
    assert (detok.stop_matched, detok.text, "".join(pieces)) == ("bc", "xa", "xa")


def test_of_stop_strings_completed_together_the_longest_cuts() -> None:
    pieces, detok = stream("a STOP", chunk=100, stop=("OP", "STOP"))
    assert (detok.stop_matched, "".join(pieces)) == ("STOP", "a ")


@pytest.mark.parametrize("chunk", [1, 100])
def test_a_stop_string_at_the_very_start_leaves_no_text(chunk: int) -> None:
    pieces, detok = stream("Hello world", chunk=chunk, stop=("Hello",))
    assert detok.stop_matched == "Hello"
    assert detok.text == "" and pieces[-1] == "" and "".join(pieces) == ""
    assert detok.add(ids("more")) is None and detok.text == ""  # nothing after a stop


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_multi_byte_characters_split_across_tokens_come_out_whole(chunk: int) -> None:
    whole = "Grüße, 東京 ☕ naïve"
    pieces, detok = stream(whole, chunk=chunk, stop=("東京 ☕!",))
    assert detok.stop_matched is None
    assert "".join(pieces) == detok.text == whole
    assert all("\ufffd" not in p for p in pieces)


def test_a_multi_byte_stop_string_split_across_tokens_matches() -> None:
    pieces, detok = stream("tea ☕ now", stop=("☕",))
    assert (detok.stop_matched, "".join(pieces)) == ("☕", "tea ")


def test_the_held_back_text_is_released_at_the_end() -> None:
    detok = Detokenizer(BACKEND, stop=("STOP", "ENDS"))
    detok.add(ids("the end ST"))
    assert detok.take(final=False) == "the end "
    assert detok.take(final=True) == "ST"
    assert detok.take(final=True) == ""


@pytest.mark.parametrize("chunk", [1, 4])
def test_stop_strings_apply_from_the_min_tokens_th_token_whatever_the_batches(
    chunk: int,
) -> None:
    """``ab`` completed by the 2nd token does not stop before ``min_tokens`` 3; the one
    completed by the 4th does, whether the four tokens come one by one or in one batch."""
    pieces, detok = stream("abab", chunk=chunk, stop=("ab",), min_tokens=3)
    assert (detok.stop_matched, "".join(pieces)) == ("ab", "ab")


def test_a_primed_decoder_continues_the_text_and_its_stop_strings() -> None:
    """A migrated request's decoder: primed with the tokens generated before (which count
    towards ``min_tokens``), of whose text the client has ``emitted`` characters."""
    detok = Detokenizer(
        BACKEND, stop=("STOP",), min_tokens=5, generated=ids("go é ST"), emitted=len("go é ")
    )
    assert detok.text == "go é ST"
    assert detok.add(ids("OP")) == "STOP"
    assert detok.take(final=False) == ""
    assert detok.text == "go é "


def test_stop_strings_match_and_hold_on_plain_text() -> None:
    stops = StopStrings(("STOP", "", "xy"))
    assert stops.strings == ("STOP", "xy")
    assert stops.match("a STOP", added=1) == (2, "STOP")
    assert stops.match("STOP then", added=4) is None  # completed before the new characters
    assert (stops.held("a ST"), stops.held("a x"), stops.held("a STOP"), stops.held("")) == (
        2,
        1,
        0,
        0,
    )
    assert not StopStrings(()) and StopStrings(()).held("anything") == 0


def test_token_codec_checks_token_id_prompts_and_the_prompt_or_messages_choice() -> None:
    codec = TokenCodec(None, vocab_size=10)
    assert codec.tokenize(Request((1, 2, 9))) == [1, 2, 9]
    with pytest.raises(InvalidRequest) as bad:
        codec.tokenize(Request([1, 10]))
    assert bad.value.param == "prompt" and "outside the vocabulary (size 10)" in bad.value.message
    with pytest.raises(InvalidRequest) as bad:
        codec.detokenize([True])
    assert bad.value.param == "tokens"
    with pytest.raises(InvalidRequest) as bad:
        codec.tokenize(Request())
    assert bad.value.param == "prompt"
    with pytest.raises(InvalidRequest) as bad:
        codec.tokenize(Request("hi", messages=[{"role": "user", "content": "hi"}]))
    assert bad.value.param == "prompt" and "not both" in bad.value.message
