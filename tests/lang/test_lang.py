"""radixserve.lang without a model: expressions, chat markers, select's boundary rule and
decision, the lazy state (fork/join concurrency, streaming, errors) and run_batch."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from lang_fakes import DEFAULT_SYSTEM, CharTokenizer, FakeBackend

import radixserve.lang as rl
from radixserve.lang.chat_template import ChatTemplate
from radixserve.lang.choice_scoring import ScoreRequest, decide, score_requests
from radixserve.lang.endpoint import _params_dict
from radixserve.lang.expr import RoleBegin, RoleEnd, Select, Text, to_ops
from radixserve.lang.interpreter import gen_params
from radixserve.lang.record import StateRecord
from radixserve.sampling_params import SamplingParams

# ---- expressions -----------------------------------------------------------------------------


def test_concatenation_and_roles_flatten_in_order():
    g = rl.gen("a", max_tokens=3)
    ops = to_ops(rl.user("Q: " + g + "!") + rl.assistant(rl.select("c", choices=["x", "y"])))
    assert ops == [
        RoleBegin("user"), Text("Q: "), g, Text("!"), RoleEnd("user"),
        RoleBegin("assistant"), Select("c", ("x", "y")), RoleEnd("assistant"),
    ]


def test_appending_a_non_string_is_a_type_error():
    s = rl.ProgramState(FakeBackend())
    with pytest.raises(TypeError, match="int"):
        s += 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-1), "temperature"),
        (dict(max_tokens=-1), "max_tokens"),
        (dict(regex="a", choices=["a"]), "at most one"),
        (dict(json_schema=3), "json_schema"),
    ],
)
def test_gen_checks_its_options_when_written(kwargs, message):
    with pytest.raises(ValueError, match=message):
        rl.gen("x", **kwargs)


def test_gen_takes_a_pydantic_model_as_schema():
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        x: int

    g = rl.gen("p", json_schema=Point)
    assert g.sampling["json_schema"]["properties"]["x"]["type"] == "integer"


@pytest.mark.parametrize("choices", [[], None, ["a", ""], "ab"])
def test_select_needs_non_empty_choices(choices):
    with pytest.raises(ValueError):
        rl.select("x", choices=choices)


def test_gen_options_override_run_defaults_which_override_max_tokens_128():
    assert gen_params(rl.gen("x"), {}).max_tokens == 128
    params = gen_params(rl.gen("x", temperature=0.5), {"temperature": 0.0, "max_tokens": 7})
    assert (params.temperature, params.max_tokens) == (0.5, 7)


def test_endpoint_sends_only_non_default_params():
    params = SamplingParams(max_tokens=5, temperature=0.0, stop=["\n"], regex="[0-9]+")
    assert _params_dict(params) == {"max_tokens": 5, "temperature": 0.0, "stop": ["\n"], "regex": "[0-9]+"}


# ---- chat template -----------------------------------------------------------------------------


def test_markers_include_the_default_system_prompt_and_the_generation_prompt():
    template = ChatTemplate(CharTokenizer())
    before, after = template.markers([], "user")
    assert before == f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\n"
    assert after == "<|im_end|>\n"
    before, _ = template.markers([{"role": "user", "content": "hi"}], "assistant")
    assert before == "<|im_start|>assistant\n"


def test_a_tokenizer_without_template_is_refused():
    class Plain:
        chat_template = None

    with pytest.raises(ValueError, match="no chat template"):
        ChatTemplate(Plain())


def test_program_text_is_what_the_template_renders():
    backend = FakeBackend(reply=lambda prompt, params: "fine")

    @rl.function
    def chat(s):
        s += rl.system("Be brief.")
        s += rl.user("How are you?")
        s += rl.assistant(rl.gen("answer"))
        s += rl.user("Sure?")

    state = chat.run(backend=backend)
    assert state["answer"] == "fine"
    assert state.text() == CharTokenizer().apply_chat_template(state.messages())
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant", "user"]
    # the gen saw the conversation up to the open assistant turn
    assert backend.calls[0][1].endswith("How are you?<|im_end|>\n<|im_start|>assistant\n")


def test_roles_cannot_nest_or_end_unopened():
    backend = FakeBackend()
    s = rl.ProgramState(backend)
    s += rl.user(rl.assistant("x"))
    with pytest.raises(ValueError, match="inside the open user message"):
        s.sync()
    s = rl.ProgramState(backend)
    s += "text" + rl.assistant_end()
    assert isinstance(s.error(), ValueError)


# ---- select --------------------------------------------------------------------------------------


def test_choice_tokens_start_where_the_tokenization_leaves_the_prefix():
    vocab = {"ab": 100}  # "a" followed by "b" merges into one token

    def encode(text):
        ids, i = [], 0
        while i < len(text):
            if text[i : i + 2] in vocab:
                ids.append(vocab[text[i : i + 2]])
                i += 2
            else:
                ids.append(ord(text[i]))
                i += 1
        return ids

    merged, plain = score_requests(encode, "xa", ["b", "c"])
    assert merged == ScoreRequest([ord("x"), 100], 1)  # the merged token is scored
    assert plain == ScoreRequest([ord("x"), ord("a"), ord("c")], 2)


def test_select_needs_a_prefix():
    with pytest.raises(ValueError, match="text before"):
        score_requests(lambda t: [ord(c) for c in t], "", ["a"])


def test_decision_by_total_or_mean_and_ties_to_the_first():
    requests = [ScoreRequest([1, 2, 3], 1), ScoreRequest([1, 4], 1)]
    logprobs = [[-1.0, -1.0], [-1.5]]
    assert decide(["long", "short"], requests, logprobs, "total").choice == "short"
    normalized = decide(["long", "short"], requests, logprobs, "token_length_normalized")
    assert normalized.choice == "long"
    assert normalized.total_logprobs == [-2.0, -1.5] and normalized.normalized_logprobs == [-1.0, -1.5]
    assert normalized.token_ids == [[2, 3], [4]]
    assert decide(["a", "b"], requests, [[-1.0], [-1.0]], "total").index == 0


def test_select_appends_the_choice_and_reports_scores():
    backend = FakeBackend()
    state = rl.ProgramState(backend)
    state += "Pick: " + rl.select("pick", choices=["a", "b", "c"])  # ids 97, 98, 99 -> -0.7, -0.8, -0.9
    assert state["pick"] == "a"
    assert state.text() == "Pick: a"
    assert state.scores("pick").total_logprobs == pytest.approx([-0.7, -0.8, -0.9])
    assert state.get_meta_info("pick")["choices"] == ["a", "b", "c"]
    (kind, requests, _), = backend.calls
    assert kind == "score" and len(requests) == 3  # one batched call


# ---- state: laziness, fork/join, streaming, errors ---------------------------------------------------


def test_forked_branches_run_concurrently_and_join_gathers_their_variables():
    backend = FakeBackend(reply=lambda prompt, params: prompt[-1], barrier=threading.Barrier(3))

    @rl.function
    def branches(s):
        s += "Root."
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f" branch {i}:" + rl.gen("leaf")
        gathered = forks.join()
        s += " done"
        return gathered

    state = branches.run(backend=backend)
    assert state.ret_value == {"leaf": [":", ":", ":"]}
    assert state["leaf"] == [":", ":", ":"]
    assert state.text() == "Root. done"
    assert sorted(call[1] for call in backend.calls) == [f"Root. branch {i}:" for i in range(3)]


def test_fork_group_appends_to_every_branch():
    state = rl.ProgramState(FakeBackend())
    state += "P"
    forks = state.fork(2)
    forks += "Q"
    assert [f.text() for f in forks] == ["PQ", "PQ"]
    with pytest.raises(ValueError):
        state.fork(0)


def test_text_iter_streams_a_gen_while_it_decodes():
    release = threading.Event()

    def reply(prompt, params):
        return "abc"

    backend = FakeBackend(reply=reply)
    original = backend.generate

    def slow_generate(prompt_ids, params, on_text=None):
        def relay(delta):
            on_text(delta)
            if delta == "a":
                release.wait(10)  # the reader must see "a" before the gen goes on

        return original(prompt_ids, params, relay)

    backend.generate = slow_generate

    @rl.function
    def story(s):
        s += "Once" + rl.gen("rest") + "."

    state = story.run(backend=backend, stream=True)
    pieces = state.text_iter("rest")
    assert next(pieces) == "a"
    release.set()
    assert "".join(pieces) == "bc"
    assert "".join(state.text_iter()) == "Onceabc."
    assert state["rest"] == "abc"


def test_a_failing_gen_stops_the_state_and_reading_raises():
    def reply(prompt, params):
        raise ValueError("invalid regex: boom")

    @rl.function
    def prog(s):
        s += "x" + rl.gen("a") + rl.gen("b")

    with pytest.raises(ValueError, match="boom"):
        prog.run(backend=FakeBackend(reply=reply))


def test_gen_on_empty_text_is_refused():
    state = rl.ProgramState(FakeBackend())
    state += rl.gen("x")
    with pytest.raises(ValueError, match="empty"):
        state["x"]


def test_reading_an_unknown_variable_names_the_known_ones():
    state = rl.ProgramState(FakeBackend())
    state += "a" + rl.gen("known")
    with pytest.raises(KeyError, match="known"):
        state["unknown"]


# ---- programs -------------------------------------------------------------------------------------------


def test_run_batch_keeps_order_and_keeps_errors_in_states():
    backend = FakeBackend(reply=lambda prompt, params: prompt.split(":")[0])

    @rl.function
    def echo(s, word):
        if word == "bad":
            raise RuntimeError("bad input")
        s += f"{word}:" + rl.gen("out", max_tokens=4)

    states = echo.run_batch([{"word": w} for w in ["one", "bad", "three"]], backend=backend, temperature=0)
    assert states[0]["out"] == "one" and states[2]["out"] == "three"
    assert isinstance(states[1].error(), RuntimeError)
    assert all(call[2].temperature == 0.0 and call[2].max_tokens == 4 for call in backend.calls)


def test_reserved_parameter_names_are_refused():
    with pytest.raises(TypeError, match="temperature"):

        @rl.function
        def prog(s, temperature):
            pass


def test_default_backend_and_no_backend():
    @rl.function
    def prog(s):
        s += "hi" + rl.gen("x")

    rl.set_default_backend(None)
    with pytest.raises(ValueError, match="no backend"):
        prog.run()
    backend = FakeBackend()
    rl.set_default_backend(backend)
    try:
        assert prog.run()["x"] == "<2>"
    finally:
        rl.set_default_backend(None)


def test_fork_record_is_a_copy_without_variables_set_since_the_fork():
    parent = StateRecord(threading.Condition())
    parent.append("text")
    parent.set_var("a", 1, {})
    child = parent.branch(threading.Condition())
    child.set_var("b", 2, {})
    child.append("more")
    assert (parent.text, parent.variables, parent.set_since_fork) == ("text", {"a": 1}, ["a"])
    assert (child.text, child.variables, child.set_since_fork) == ("textmore", {"a": 1, "b": 2}, ["b"])


# ---- module structure: imports go one way ---------------------------------------------------------------

LANG_DIR = Path(rl.__file__).parent
LANG_MODULES = sorted(m.name for m in pkgutil.iter_modules([str(LANG_DIR)]))


def _lang_imports(tree: ast.Module) -> list[tuple[str, bool]]:
    """(imported radixserve.lang module, whether the import sits inside a function) for
    every import in the tree, TYPE_CHECKING blocks included; `from radixserve.lang import
    x` counts as importing the package itself."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names = [child.module]
            elif isinstance(child, ast.ImportFrom):
                names = ["radixserve.lang." + (child.module or "")]  # relative: inside the package
            found.extend((name, in_function) for name in names if name.startswith("radixserve.lang"))
            visit(child, nested)

    visit(tree, False)
    return found


def test_lang_modules_import_one_way():
    """No module imports another inside a function, and the module-level import graph
    (TYPE_CHECKING imports included) has no cycle."""
    graph: dict[str, set[str]] = {}
    for name in [*LANG_MODULES, "__init__"]:
        tree = ast.parse((LANG_DIR / f"{name}.py").read_text())
        imports = _lang_imports(tree)
        local = sorted(target for target, in_function in imports if in_function)
        assert not local, f"radixserve/lang/{name}.py imports {local} inside a function"
        targets = {target.removeprefix("radixserve.lang").lstrip(".") or "__init__" for target, _ in imports}
        graph[name] = targets
    assert graph["__init__"] >= {"fork", "state", "program"}, graph["__init__"]

    done: set[str] = set()

    def walk(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(node):], node]))
        if node in done:
            return
        for target in sorted(graph.get(node, ())):
            walk(target, [*path, node])
        done.add(node)

    for name in graph:
        walk(name, [])
    assert graph["fork"] == {"record"} and "state" not in graph["interpreter"]


@pytest.mark.parametrize("module", LANG_MODULES)
def test_each_lang_module_imports_alone(module):
    """Import the module in a fresh interpreter with the package's __init__ replaced by an
    empty package, so nothing the __init__ imports first can hide an import-order cycle."""
    code = (
        "import importlib, sys, types\n"
        "import radixserve\n"
        f"pkg = types.ModuleType('radixserve.lang'); pkg.__path__ = [{str(LANG_DIR)!r}]\n"
        "sys.modules['radixserve.lang'] = pkg\n"
        f"importlib.import_module('radixserve.lang.{module}')\n"
        f"import radixserve.lang.{module}\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    plain = subprocess.run([sys.executable, "-c", f"import radixserve.lang.{module}"], capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr
