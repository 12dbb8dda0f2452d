"""Pieces both OpenAI endpoints share: the creation time and a choice's finish reason."""

from __future__ import annotations

import time

from radixserve.outputs import RequestOutput


def now_s() -> int:
    return int(time.time())


def finish_reason(output: RequestOutput) -> str | None:
    return output.finish_reason if output.finished else None
