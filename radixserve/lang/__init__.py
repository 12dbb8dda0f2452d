"""radixserve.lang: programs of gens, selects, roles and forks over a prefix-caching engine.

    import radixserve.lang as rl

    @rl.function
    def triage(s, ticket):
        s += rl.system("You sort support tickets.")
        s += rl.user(ticket)
        s += rl.assistant(rl.select("team", choices=["billing", "tech", "sales"]))
        s += rl.user("Why?")
        s += rl.assistant(rl.gen("why", max_tokens=48, stop="\\n"))

    state = triage.run(ticket="I was charged twice", backend=rl.Runtime())
    state["team"], state["why"], state.scores("team")
    states = triage.run_batch([{"ticket": t} for t in tickets], progress_bar=True)

Backends: `rl.Runtime(**engine_options)` (in process) and `rl.Endpoint(url)` (a
`radixserve serve` server); `rl.set_default_backend(...)` for runs that name none.
"""

from radixserve.lang.backend import Backend, Completion, get_default_backend, hit_rate, set_default_backend
from radixserve.lang.choice_scoring import SelectResult
from radixserve.lang.endpoint import Endpoint, EndpointError
from radixserve.lang.fork import ForkGroup
from radixserve.lang.primitives import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    select,
    system,
    system_begin,
    system_end,
    tools,
    user,
    user_begin,
    user_end,
)
from radixserve.lang.program import Program, function
from radixserve.lang.runtime import Runtime
from radixserve.lang.state import ProgramState

__all__ = [
    "Backend",
    "Completion",
    "Endpoint",
    "EndpointError",
    "ForkGroup",
    "Program",
    "ProgramState",
    "Runtime",
    "SelectResult",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "function",
    "gen",
    "get_default_backend",
    "hit_rate",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "tools",
    "user",
    "user_begin",
    "user_end",
]
