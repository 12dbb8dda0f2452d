"""The reasoning parsers without a model: each format split into reasoning and content the
same whole and streamed (any chunking), the spans the token count reads, `auto` from the
template, the reasoning block put ahead of a constraint, and the template arguments checked."""

from __future__ import annotations

import asyncio

import pytest

from radixserve.sampling_params import SamplingParams
from radixserve.server.errors import APIError
from radixserve.server.protocol import ChatCompletionRequest, parse
from radixserve.reasoning.base import Span
from radixserve.reasoning.mode import ReasoningMode
from radixserve.reasoning.registry import CHOICES, detect_parser, parser_named
from radixserve.server.reasoning import Reasoning
from radixserve.reasoning.tokens import reasoning_tokens

HARMONY = ("<|channel|>analysis<|message|>Let me think.<|end|><|start|>assistant<|channel|>final<|message|>"
           "It is 4.<|return|>")
HARMONY_CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>")

CASES = [
    # (parser, prompt opened the block, generated text, reasoning, content)
    ("deepseek_r1", True, "I should add.\n</think>\n\nThe sum is 4.", "I should add.\n", "The sum is 4."),
    ("deepseek_r1", True, "<think>x</think>y", "x", "y"),
    ("deepseek_r1", True, "no end marker, all reasoning </thi", "no end marker, all reasoning </thi", ""),
    ("qwen3", False, "<think>\nhmm\n</think>\n\nanswer </think> stays", "\nhmm\n", "answer </think> stays"),
    ("qwen3", False, "  plain answer <think>not reasoning</think>", "", "  plain answer <think>not reasoning</think>"),
    ("qwen3", True, "opened by the prompt</think>rest", "opened by the prompt", "rest"),
    ("gpt_oss", False, HARMONY, "Let me think.", "It is 4."),
    ("gpt_oss", False, HARMONY_CALL, "Need the weather.",
     "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
     "{\"city\": \"Paris\"}<|call|>"),
    ("gpt_oss", False, "no harmony at all", "", "no harmony at all"),
]


def split(name: str, opened: bool, text: str, chunk: int) -> tuple[str, str, list[Span]]:
    splitter = parser_named(name).splitter(opened)
    pieces = []
    for at in range(0, len(text), chunk):
        pieces += splitter.feed(text[at: at + chunk])
    pieces += splitter.finish()
    assert all(p.text for p in pieces)
    reasoning = "".join(p.text for p in pieces if p.reasoning)
    content = "".join(p.text for p in pieces if not p.reasoning)
    return reasoning, content, splitter.spans


@pytest.mark.parametrize("name,opened,text,reasoning,content", CASES)
def test_every_chunking_splits_the_text_alike(name, opened, text, reasoning, content):
    whole = split(name, opened, text, len(text))
    assert whole[:2] == (reasoning, content)
    for chunk in (1, 2, 3, 5, 7):
        assert split(name, opened, text, chunk) == whole


def test_a_span_covers_the_block_with_its_markers():
    _, _, spans = split("qwen3", False, "  <think>ab</think>cd", 1)
    assert spans == [Span(2, 19)]  # from "<think>" to the end of "</think>"
    _, _, spans = split("deepseek_r1", True, "never closed", 4)
    assert spans == [Span(0, None)]


def test_reasoning_tokens_count_the_tokens_holding_the_block():
    # Each token is two characters: "  <think>ab</think>cd" -> tokens 0..10.
    text = "  <think>ab</think>cd"
    ids = list(range((len(text) + 1) // 2))
    decode = lambda prefix: text[: 2 * len(prefix)]  # noqa: E731
    # The block spans characters [2, 19): tokens 1 (chars 2-3) to 9 (chars 18-19).
    assert reasoning_tokens([Span(2, 19)], ids, decode) == 9
    assert reasoning_tokens([Span(0, None)], ids, decode) == len(ids)
    assert reasoning_tokens([Span(3, 18)], ids, decode) == 8  # inside tokens 1 and 8


class FakeTokenizer:
    def __init__(self, template: str, generation_prompt: str):
        self.chat_template = template
        self.generation_prompt = generation_prompt

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kwargs):
        if kwargs.get("enable_thinking") is False:
            return "<|user|>x<|assistant|><think>\n\n</think>\n\n"
        return "<|user|>x" + self.generation_prompt

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i) for i in ids)


def test_auto_reads_the_template_in_force():
    r1 = FakeTokenizer("... {{ '</think>' }} ...", "<|assistant|><think>\n")
    qwen = FakeTokenizer("{% if enable_thinking %}...{% endif %}</think>", "<|assistant|>")
    harmony = FakeTokenizer("<|channel|>analysis<|message|>{{ m.thinking }}<|end|>", "<|start|>assistant")
    plain = FakeTokenizer("<|im_start|>{{ m.content }}", "<|im_start|>assistant\n")
    assert detect_parser(r1).name == "deepseek_r1"
    assert detect_parser(qwen).name == "qwen3"
    assert detect_parser(harmony).name == "gpt_oss"
    assert detect_parser(plain) is None and detect_parser(None) is None
    assert set(CHOICES) == {"none", "auto", "deepseek_r1", "qwen3", "gpt_oss"}


def test_a_request_that_turns_thinking_off_reads_no_reasoning():
    qwen = Reasoning(FakeTokenizer("</think>", "<|assistant|><think>\n"), "qwen3")
    assert qwen.mode({}).opened  # this template opens the block in the prompt
    assert qwen.mode({"enable_thinking": False}) is None
    assert Reasoning(FakeTokenizer("</think>", "<|assistant|>"), "qwen3").mode({}).opened is False
    harmony = Reasoning(FakeTokenizer("x", "<|start|>assistant"), "gpt_oss")
    assert harmony.mode({"enable_thinking": False}) is not None  # gpt-oss always reasons
    assert Reasoning(FakeTokenizer("</think>", ""), "none").mode({}) is None


def test_a_constraint_applies_after_the_reasoning_block():
    mode = ReasoningMode(parser_named("deepseek_r1"), True, budget=8)
    params = mode.apply(SamplingParams(json_schema={"type": "object"}, max_tokens=50))
    assert params.json_schema is None and not params.json_object
    block, answer = params.structural_tag["format"]["elements"]
    assert block == {"type": "tag", "begin": "", "content": {"type": "any_text", "max_tokens": 8}, "end": "</think>"}
    assert answer["type"] == "grammar" and "root ::=" in answer["grammar"]  # compact JSON, as elsewhere
    free = ReasoningMode(parser_named("qwen3"), False).apply(SamplingParams(choices=["a", "b"]))
    optional, answer = free.structural_tag["format"]["elements"]
    assert optional["type"] == "optional" and optional["content"]["begin"] == "<think>"
    assert answer == {"type": "regex", "pattern": "(a|b)"}
    assert ReasoningMode(parser_named("qwen3"), False).apply(SamplingParams()).structural_tag is None
    budget_only = ReasoningMode(parser_named("qwen3"), True, budget=4).apply(SamplingParams())
    assert budget_only.structural_tag["format"]["elements"][1] == {"type": "any_text"}
    assert ReasoningMode(parser_named("gpt_oss"), False).apply(SamplingParams()).skip_special_tokens is False


def test_the_forced_end_marker_compiles_and_follows_the_budget(real_model_dir):
    """Through xgrammar on the default model's tokenizer: after `budget` tokens of reasoning
    only `</think>` may follow, then the JSON answer."""
    import json

    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    params = ReasoningMode(parser_named("deepseek_r1"), True, budget=3).apply(
        SamplingParams(json_schema={"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer),
                                              stop_token_ids=[tokenizer.eos_token_id])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_structural_tag(json.dumps(params.structural_tag)))
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    text = ""
    for token in tokenizer.encode(" one two three", add_special_tokens=False):
        assert matcher.accept_token(token)
        text += tokenizer.decode([token])
    while not matcher.is_terminated():
        matcher.fill_next_token_bitmask(mask)
        allowed = [t for t in range(info.vocab_size) if (int(mask[0, t // 32]) >> (t % 32)) & 1]
        token = min(allowed)
        if token == tokenizer.eos_token_id:
            break
        assert matcher.accept_token(token)
        text += tokenizer.decode([token])
    assert text.startswith(" one two three</think>")
    assert json.loads(text[len(" one two three</think>"):]) in ({"a": 1}, {"a": 2})


@pytest.mark.parametrize("extra,param", [
    ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"thinking_token_budget": 0}, "thinking_token_budget"),
])
def test_bad_template_arguments_are_a_400(extra, param):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    with pytest.raises(APIError) as caught:
        parse(ChatCompletionRequest, body).template_kwargs()
    assert caught.value.status == 400 and caught.value.param == param


def test_template_arguments_reach_the_template_and_a_budget_needs_a_parser():
    from radixserve.server.api.chat import chat_reasoning

    body = parse(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                         "chat_template_kwargs": {"enable_thinking": True, "custom": [1]},
                                         "reasoning_effort": "low", "thinking_token_budget": 5})
    assert body.template_kwargs() == {"enable_thinking": True, "custom": [1], "reasoning_effort": "low"}
    with pytest.raises(APIError) as caught:
        asyncio.run(chat_reasoning(body, Reasoning(FakeTokenizer("", ""), "none")))
    assert caught.value.status == 400 and caught.value.param == "thinking_token_budget"
    mode = asyncio.run(chat_reasoning(body, Reasoning(FakeTokenizer("</think>", "<think>"), "qwen3")))
    assert mode.budget == 5 and mode.opened


def test_the_parser_follows_the_template_in_force():
    class Tokenizer(FakeTokenizer):
        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, chat_template=None,
                                **kwargs):
            return "<|assistant|><think>\n" if chat_template and "open" in chat_template else "<|assistant|>"

    plain = Tokenizer("<|im_start|>{{ m.content }}", "")
    assert Reasoning(plain).parser is None
    served = Reasoning(plain, chat_template="open {{ '</think>' }}")  # --chat-template
    assert served.parser.name == "deepseek_r1"
    own = Reasoning(plain).for_template("{{ '</think>' }}")  # a request's own template
    assert own.parser.name == "qwen3" and own.mode({}).opened is False
    assert Reasoning(plain).for_template(None).parser is None
    assert Reasoning(plain, "none").for_template("open </think>").parser is None


def test_harmony_reasoning_then_the_final_channel_under_a_budget(real_model_dir):
    """gpt_oss's markers are special tokens: the grammar names them as tokens. On the default
    tokenizer with harmony's markers added, three tokens of analysis, then the final channel's
    JSON; the splitter reads it back."""
    import json

    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|return|>"]})
    stop = tokenizer.convert_tokens_to_ids("<|return|>")
    params = ReasoningMode(parser_named("gpt_oss"), False, budget=3).apply(
        SamplingParams(json_schema={"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[stop])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_structural_tag(json.dumps(params.structural_tag)))
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    wanted = tokenizer.encode("<|channel|>analysis<|message|> one two three four", add_special_tokens=False)
    out: list[int] = []
    while not matcher.is_terminated():
        matcher.fill_next_token_bitmask(mask)
        allowed = {t for t in range(info.vocab_size) if (int(mask[0, t // 32]) >> (t % 32)) & 1}
        token = wanted[len(out)] if len(out) < len(wanted) and wanted[len(out)] in allowed else min(allowed)
        if token == stop:
            break
        assert matcher.accept_token(token)
        out.append(token)
    text = tokenizer.decode(out, skip_special_tokens=False)
    assert text == '<|channel|>analysis<|message|> one two three<|end|><|start|>assistant<|channel|>final<|message|>{"a": 1}'
    reasoning, content, spans = split("gpt_oss", False, text, 3)
    assert (reasoning, json.loads(content), spans) == (" one two three", {"a": 1}, [Span(0, text.index("<|start|>"))])


def test_a_call_written_inside_the_reasoning_is_reasoning_and_the_call_after_it_parses():
    """The tool-call parser sees only the content after the block, streamed or whole; the
    reasoning tokens are the ones holding the block (one character a token here)."""
    from dataclasses import replace as with_

    from radixserve.outputs import OutputDelta, RequestOutput
    from radixserve.server.output.events import CallArguments, CallStart, Finish, OutputEvents, ReasoningDelta, TextDelta
    from radixserve.tools import HERMES
    from radixserve.tools.parser import ToolCallParser

    thought = 'maybe <tool_call>\n{"name": "add", "arguments": {"a": 9}}\n</tool_call>'
    text = thought + '</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    mode = ReasoningMode(parser_named("deepseek_r1"), True, decode=lambda ids: text[: len(ids)])

    def run(piece: int) -> list:
        events, sent, out = OutputEvents(ToolCallParser(HERMES, {"add"}), mode), 0, []
        for end in range(piece, len(text) + piece, piece):
            end = min(end, len(text))
            output = RequestOutput("r", None, [1], list(range(end)), text[:end], end == len(text),
                                   "stop" if end == len(text) else None)
            output.delta = OutputDelta(list(range(sent, end)), None, text[sent:end], sent == 0)
            out += events.step(output)
            sent = end
        return out

    for piece in (1, 4, len(text)):
        events = run(piece)
        assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == thought
        assert [e.name for e in events if isinstance(e, CallStart)] == ["add"]
        assert "".join(e.text for e in events if isinstance(e, CallArguments)) == '{"a": 1}'
        assert not [e for e in events if isinstance(e, TextDelta)]
        finish = events[-1]
        assert isinstance(finish, Finish) and finish.num_calls == 1
        assert finish.usage.reasoning_tokens == len(thought) + len("</think>")
        assert with_(finish.usage, reasoning_tokens=None).openai()["completion_tokens"] == len(text)


def test_a_schema_xgrammar_refuses_is_a_400_after_reasoning_too():
    from radixserve.server.protocol.jobs import GenerationJob
    from radixserve.server.reasoning import with_reasoning

    job = GenerationJob("m", [[1]], [SamplingParams(json_schema={"type": "object", "minProperties": "x"})], 1, False, False)
    with pytest.raises(APIError) as caught:
        with_reasoning(job, ReasoningMode(parser_named("qwen3"), False))
    assert caught.value.status == 400 and "json schema" in caught.value.message


@pytest.mark.parametrize("family,parser", [
    ("harmony", "gpt_oss"), ("hermes", None), ("llama3_json", None), ("pythonic", None), ("mistral", None),
    ("qwen3_coder", None), ("deepseek_v3", None), ("gemma3", None),
])
def test_auto_on_each_family_template(family, parser, real_model_dir):
    """The test templates of the tool-call families (tests/templates/): only harmony's
    speaks of reasoning."""
    from pathlib import Path

    from transformers import AutoTokenizer

    template = (Path(__file__).parents[1] / "templates" / f"{family}.jinja").read_text()
    found = Reasoning(AutoTokenizer.from_pretrained(real_model_dir), chat_template=template).parser
    assert (found.name if found is not None else None) == parser
