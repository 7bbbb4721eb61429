"""Tool calling without a model: syntax detection, request validation, the grammar, the
conversation rendering, and the parser of the model's output (whole and streamed)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from stoic.errors import InvalidRequest
from stoic.http._toolconv import render_conversation
from stoic.http._toolparse import ToolCallStream, parse_output, scan
from stoic.http._tools import ToolPlan, ToolSyntax, calls_grammar, tool_plan, tool_syntax
from stoic.request import Constraint, GrammarVocab
from stoic.sampling import LLGuidanceBackend

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
HERMES = ToolSyntax("hermes", native=False)
MISTRAL = ToolSyntax("mistral", native=True)
LLAMA3 = ToolSyntax("llama3", native=True)


def _plan(
    syntax: ToolSyntax = HERMES, choice: Any = None, parallel: bool | None = None
) -> ToolPlan:
    return tool_plan([WEATHER, TIME], choice, parallel, syntax)


def _stream(text_pieces: list[str], plan: ToolPlan) -> tuple[str, list[tuple[str, str]]]:
    """Feed the pieces; the content and the calls (name, arguments) as a client gets them:
    each call once, whole, its arguments valid JSON, indexes in order."""
    parser = ToolCallStream(plan)
    content: list[str] = []
    calls: list[tuple[str, str]] = []
    for i, piece in enumerate(text_pieces):
        text, new = parser.feed(piece, final=i == len(text_pieces) - 1)
        content.append(text)
        for call in new:
            assert call.index == len(calls)
            json.loads(call.arguments)
            calls.append((call.name, call.arguments))
    return "".join(content), calls


def test_syntax_is_read_from_the_chat_template() -> None:
    """Each known template is recognised; a template without tools is the generic syntax."""
    assert tool_syntax(None) == ToolSyntax("hermes", native=False)
    assert tool_syntax("{{ messages }}") == ToolSyntax("hermes", native=False)
    assert tool_syntax("{% if tools %}<tool_call>{% endif %}").kind == "hermes"
    assert tool_syntax("{% if tools %}[TOOL_CALLS]{% endif %}") == MISTRAL
    llama = '{% if tools %}{"name": function name, "parameters": dictionary of ...{% endif %}'
    assert tool_syntax(llama) == LLAMA3
    assert tool_syntax({"default": "x", "tool_use": "{{ tools }}<tool_call>"}).native


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ([{"type": "retrieval"}], None, "tools.0"),
        ([{"type": "function"}], None, "tools.0"),
        ([{"type": "function", "function": {"name": "a b"}}], None, "tools.0"),
        ([WEATHER, WEATHER], None, "tools.1"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "tools.0"),
        (None, "required", "tool_choice"),
        ([WEATHER], "sometimes", "tool_choice"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([WEATHER], {"type": "function"}, "tool_choice"),
    ],
)
def test_malformed_tools_name_the_field(tools: Any, choice: Any, param: str) -> None:
    """A malformed tool or tool_choice is an InvalidRequest naming the field."""
    with pytest.raises(InvalidRequest) as info:
        tool_plan(tools, choice, None, HERMES)
    assert info.value.param == param


def test_choice_defaults_follow_openai() -> None:
    """No tool_choice means auto with tools and none without; none offers nothing."""
    assert _plan().choice == "auto" and _plan().offered
    assert tool_plan(None, None, None, HERMES).choice == "none"
    assert not _plan(choice="none").offered
    assert _plan(choice="none").constraint(None) is None
    assert _plan().constraint(None) is None  # auto alone: no grammar


def test_forced_calls_conflict_with_other_constraints() -> None:
    """required + a response_format, or auto + a regex, are 400s; auto + JSON is a union."""
    json_object = Constraint("json_object", "", "response_format")
    with pytest.raises(InvalidRequest):
        _plan(choice="required").constraint(json_object)
    with pytest.raises(InvalidRequest):
        _plan().constraint(Constraint("regex", "a+", "structured_outputs"))
    union = _plan().constraint(json_object)
    assert union is not None and union.kind == "grammar" and "answer" in union.text


@pytest.fixture(scope="module")
def grammars(default_model_dir: Path) -> tuple[LLGuidanceBackend, Any]:
    """The grammar backend over the default model's tokenizer, and the tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    vocab = GrammarVocab.from_tokenizer(tokenizer, 49152, frozenset({tokenizer.eos_token_id}))
    return LLGuidanceBackend(vocab), tokenizer


def _accepts(grammars: tuple[LLGuidanceBackend, Any], grammar: str, text: str) -> bool:
    """The grammar accepts ``text`` whole (every token, and the end after them)."""
    backend, tokenizer = grammars
    matcher = backend.compile(Constraint("grammar", grammar, "tool_choice")).matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept(t) for t in ids) and bool(matcher.llmatcher.is_accepting())


@pytest.mark.parametrize(
    ("syntax", "good", "bad"),
    [
        (
            HERMES,
            '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>',
            '<tool_call>\n{"name":"get_weather","arguments":{"town":"Oslo"}}\n</tool_call>',
        ),
        (
            LLAMA3,
            '{"name":"get_time","parameters":{}}; {"name":"get_weather","parameters":{"city":"A"}}',
            '{"name":"get_time","arguments":{}}',
        ),
        (
            MISTRAL,
            '[TOOL_CALLS][{"name":"get_time","arguments":{}}]',
            '[TOOL_CALLS][{"name":"get_time","arguments":{}},]',
        ),
    ],
)
def test_calls_grammar_follows_each_function_schema(
    grammars: tuple[LLGuidanceBackend, Any], syntax: ToolSyntax, good: str, bad: str
) -> None:
    """The grammar accepts calls whose arguments follow their function's schema, in the
    syntax's framing, and nothing else (unknown arguments included)."""
    plan = _plan(syntax)
    grammar = "start: calls\n" + calls_grammar(syntax, plan.tools, parallel=True)
    assert _accepts(grammars, grammar, good)
    assert not _accepts(grammars, grammar, bad)


def test_one_call_when_not_parallel(grammars: tuple[LLGuidanceBackend, Any]) -> None:
    """parallel_tool_calls false: the grammar allows one call only."""
    plan = _plan(parallel=False)
    grammar = "start: calls\n" + calls_grammar(HERMES, plan.tools, parallel=False)
    one = '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>'
    assert _accepts(grammars, grammar, one)
    assert not _accepts(grammars, grammar, one + "\n" + one)


def test_generic_rendering_turns_calls_and_results_into_text() -> None:
    """Without a tool template: tools in the system message, calls in the assistant's text,
    consecutive results merged into one user message (roles keep alternating)."""
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        {
            "id": "c2",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        },
    ]
    messages = [
        {"role": "user", "content": "time and weather?"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "12:00", "tool_call_id": "c1"},
        {"role": "tool", "content": "sunny", "tool_call_id": "c2"},
    ]
    rendered, kwargs = render_conversation(messages, _plan(), HERMES, {"x": 1})
    assert kwargs == {"x": 1}
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert '"name": "get_weather"' in rendered[0]["content"]
    assert rendered[2]["content"].count("<tool_call>") == 2
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in rendered[2]["content"]
    assert rendered[3]["content"] == (
        "<tool_response>\n12:00\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"
    )


def test_native_rendering_hands_tools_and_objects_to_the_template() -> None:
    """A tool template gets ``tools``, calls with object arguments, and tool messages with
    the called function's name."""
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "12:00", "tool_call_id": "c1"},
    ]
    native = ToolSyntax("hermes", native=True)
    rendered, kwargs = render_conversation(messages, _plan(native), native, None)
    assert kwargs is not None and [t["function"]["name"] for t in kwargs["tools"]] == [
        "get_weather",
        "get_time",
    ]
    assert rendered[0] == {"role": "system", "content": "be brief"}
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {}
    assert rendered[2]["name"] == "get_time"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == "{}"  # input untouched


def test_scan_returns_valid_calls_and_keeps_the_rest_as_text() -> None:
    """A call is returned only if it parses and names a tool; everything else stays text."""
    plan = _plan()
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    unknown = '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>'
    broken = '<tool_call>\n{"name": "get_time", "arguments": {\n</tool_call>'
    found = scan("Let me look.\n" + good + "\n" + unknown, plan, final=True)
    assert [c.name for c in found.calls] == ["get_weather"]
    assert found.calls[0].arguments == '{"city": "Oslo"}'
    assert found.content == 'Let me look.\n{"name": "launch", "arguments": {}}'
    text = "Hello " + broken
    assert scan(text, plan, final=True).content == text
    assert scan("just text", plan, final=True).calls == ()


def test_scan_reads_each_syntax() -> None:
    """Mistral's bracketed list and llama3's bare objects give the same calls."""
    mistral = '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "A"}}]'
    found = scan(mistral, _plan(MISTRAL), final=True)
    assert [c.name for c in found.calls] == ["get_time", "get_weather"]
    assert found.content == ""
    llama = '{"name": "get_weather", "parameters": {"city": "B"}}'
    found = scan(llama, _plan(LLAMA3), final=True)
    assert [(c.name, c.arguments) for c in found.calls] == [("get_weather", '{"city": "B"}')]
    assert scan('{"answer": 1}', _plan(LLAMA3), final=True).calls == ()


def test_arguments_written_as_a_string_are_unwrapped() -> None:
    """Some models write the arguments as JSON text in a string: returned as the object."""
    text = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>'
    (call,) = scan(text, _plan(), final=True).calls
    assert json.loads(call.arguments) == {"city": "Rome"}


def test_not_parallel_returns_the_first_call() -> None:
    """parallel_tool_calls false: one call comes back even if the model wrote two."""
    one = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert len(scan(one + one, _plan(parallel=False), final=True).calls) == 1


def test_call_ids_are_unique_and_mistral_shaped() -> None:
    """Ids are fresh per call; Mistral's are 9 letters and digits."""
    text = '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]'
    ids = {parse_output(text, _plan(MISTRAL)).calls[0].id for _ in range(20)}
    assert len(ids) == 20 and all(len(i) == 9 and i.isalnum() for i in ids)


def test_a_marker_prefix_is_held_back_then_released() -> None:
    """Text that may begin a call is not streamed until it is known not to be one."""
    parser = ToolCallStream(_plan())
    assert parser.feed("Hi <tool", final=False) == ("Hi", [])
    assert parser.feed("box> ok", final=False) == (" <toolbox> ok", [])


_CALL_TEXTS = [
    'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "O\\"slo {x}"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Z"}}]',
    '{"name": "get_weather", "parameters": {"city": "Lima"}}; {"name": "get_time", "parameters": {}}',
    "plain text with <tool_ and { braces }",
    '<tool_call>{"name": "nope", "arguments": {}}</tool_call> trailing',
]


@settings(max_examples=200, deadline=None)
@given(
    which=st.integers(0, len(_CALL_TEXTS) - 1),
    cuts=st.lists(st.integers(1, 200), max_size=30),
    choice=st.sampled_from(["auto", "required"]),
    length=st.integers(0, 250),
)
def test_streamed_pieces_join_to_the_whole(
    which: int, cuts: list[int], choice: str, length: int
) -> None:
    """However the text is cut into deltas, and wherever max_tokens ends it, the streamed
    content and calls (each call once, whole, its arguments valid JSON) equal the non-streamed
    result."""
    text = _CALL_TEXTS[which][:length]
    syntax = [HERMES, MISTRAL, LLAMA3, HERMES, HERMES][which]
    plan = _plan(syntax, choice=choice)
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(points)] or [text]
    content, calls = _stream(pieces, plan)
    whole = parse_output(text, plan)
    assert content == (whole.content or "")
    assert calls == [(c.name, c.arguments) for c in whole.calls]


_TWO_CALLS = (
    '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
)


@pytest.mark.parametrize("choice", ["auto", "required"])
@pytest.mark.parametrize("parallel", [True, False])
def test_a_cut_off_call_is_dropped_whole_and_streamed(choice: str, parallel: bool) -> None:
    """Whatever the length max_tokens cuts the answer to: a call is returned only if its object
    is complete, the call cut off is dropped, and no piece of a tag (``</tool_call``,
    ``<tool``) reaches the content; streamed, the same content and calls, and no call is ever
    sent with arguments that do not parse."""
    plan = _plan(choice=choice, parallel=parallel)
    tags = [0, _TWO_CALLS.index("<tool_call>", 1)]
    #: each call: where its opening tag ends and where its object ends
    calls_at = [(a + len("<tool_call>"), _TWO_CALLS.index("}}", a) + 2) for a in tags]
    for n in range(len(_TWO_CALLS) + 1):
        text = _TWO_CALLS[:n]
        whole = parse_output(text, plan)
        complete = [end <= n for _, end in calls_at]
        assert len(whole.calls) == (complete[1] + complete[0] if parallel else complete[0]), text
        assert not whole.content, text  # only calls (or a piece of a tag) were written
        assert whole.cut == any(opened <= n < end for opened, end in calls_at), text
        pieces = [text[k : k + 3] for k in range(0, len(text), 3)] or [""]
        content, calls = _stream(pieces, plan)
        assert content == "" and calls == [(c.name, c.arguments) for c in whole.calls]


def test_text_before_a_cut_off_call_stays_content() -> None:
    """auto: the model's text before a call that max_tokens cut off is the content, without the
    call or its tag; text after the calls keeps no tag either, nor a marker cut off."""
    plan = _plan()
    found = parse_output('Let me check.\n<tool_call>\n{"name": "get_weather", "argu', plan)
    assert found.content == "Let me check." and found.calls == () and found.cut
    call = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    found = parse_output(f"{call}\nAnd then <tool_call>\n{{", plan)
    assert found.content == "And then" and len(found.calls) == 1
    found = parse_output(f"{call}\nAnd then <tool_ca", plan)
    assert found.content == "And then" and len(found.calls) == 1 and not found.cut
    assert parse_output("Hello <tool", plan).content == "Hello"  # a marker cut off
    assert parse_output("Hello <toolbox", plan).content == "Hello <toolbox"  # text


def test_a_cut_off_llama3_object_is_a_call_only_once_it_names_a_tool() -> None:
    """llama3 (bare objects): a cut-off first object that names a tool is a dropped call; one
    that does not (a JSON answer cut by max_tokens) stays content."""
    plan = _plan(LLAMA3)
    cut_call = parse_output('{"name": "get_weather", "parameters": {"ci', plan)
    assert cut_call.content is None and cut_call.calls == () and cut_call.cut
    answer = '{"answer": "the weather is'
    assert parse_output(answer, plan).content == answer
    two = '{"name": "get_time", "parameters": {}}; {"na'
    found = parse_output(two, plan)
    assert [c.name for c in found.calls] == ["get_time"] and found.content is None


def test_a_mistral_list_cut_off_keeps_its_complete_calls() -> None:
    """Mistral: the complete calls of a list max_tokens cut off are returned, the cut one
    dropped, and a cut marker is not content."""
    plan = _plan(MISTRAL)
    text = '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_weather", "argum'
    found = parse_output(text, plan)
    assert [c.name for c in found.calls] == ["get_time"] and found.content is None
    assert found.cut
    assert parse_output("[TOOL_CA", _plan(MISTRAL, choice="required")).content is None
    assert parse_output("Sure [TOOL_CA", plan).content == "Sure"
