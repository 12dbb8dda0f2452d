"""bench_agent_conditions: its ideal reuse, and its client on a served real model (the default),
where re-rendered turns and few-shot questions hit everything but each turn's new tokens."""

from __future__ import annotations

import pytest

from bench.bench_agent_conditions import ChatAgents, Client, FewShot, ideal_reuse
from radixserve.server import ServerOptions, create_app
from radixserve.server.testing import BackgroundServer


def test_ideal_reuse_is_the_longest_common_prefix_less_the_last_token():
    assert ideal_reuse([1, 2, 3], []) == 0
    assert ideal_reuse([1, 2, 3, 4], [[1, 2, 9], [1, 2, 3, 7, 7]]) == 3
    assert ideal_reuse([1, 2, 3], [[1, 2, 3, 4]]) == 2  # the prompt's last token is always computed
    assert ideal_reuse([5, 6], [[1, 2]]) == 0


@pytest.mark.real_model
def test_the_client_records_usage_answers_and_the_ideal(real_engine):
    real_engine.flush_cache()
    app = create_app(real_engine, ServerOptions())
    with BackgroundServer(app) as server:
        client = Client(server.url, real_engine.model_name, token_ids=True)
        ChatAgents(agents=2, turns=2, system_words=120, reply_tokens=4).run(client)
        agents = client.record
        client.record, client._seen = type(agents)(), []
        FewShot(questions=3, examples=8, answer_tokens=2, concurrency=1).run(client)
        fewshot = client.record
    real_engine.check_integrity()
    real_engine.flush_cache()
    assert sorted(agents.answers) == ["agent0/turn0", "agent0/turn1", "agent1/turn0", "agent1/turn1"]
    assert sorted(fewshot.answers) == ["question0", "question1", "question2"]
    for record in (agents, fewshot):
        # the cache never reuses more than was there before; block granularity loses < 16 a request
        assert 0 < record.cached_tokens <= record.ideal_tokens < record.prompt_tokens
        assert record.ideal_tokens - record.cached_tokens < 16 * len(record.answers)
    # questions 1 and 2 reuse the whole few-shot block, the first nothing
    assert fewshot.ideal_tokens > 2 * 8 * 10
