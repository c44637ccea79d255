"""The load generator against a real zero-latency mock engine process (about a second of load)."""

from __future__ import annotations

from shepherd.loadgen.client import LoadSpec, run_load
from shepherd.loadgen.http1 import RequestTemplate
from shepherd.loadgen.procstat import TreeCpuTracker
from shepherd.loadgen.prompts import ChatRequestSource, ChatShape, PromptConfig, PromptFactory
from tests.e2e.procs import start_mock_engine


async def test_loadgen_against_mock_engine() -> None:
    with start_mock_engine("--zero-latency", "--model", "qwen3") as engine:
        factory = PromptFactory(PromptConfig(prompt_tokens=250))
        template = RequestTemplate("127.0.0.1", engine.http_port, "/v1/chat/completions")
        tracker = TreeCpuTracker(engine.pid)
        before = tracker.sample()
        for stream in (False, True):
            source = ChatRequestSource(
                factory, template, ChatShape(model="qwen3", max_tokens=8, stream=stream)
            )
            spec = LoadSpec(
                "127.0.0.1", engine.http_port, concurrency=4, duration_s=0.6, warmup_s=0.2, stream=stream
            )
            result = await run_load(spec, source)
            assert result.ok > 0, engine.log()
            assert result.errors == {}, engine.log()
            if stream:
                assert result.ttft.count == result.ok
                assert result.content_events >= result.ok
        assert tracker.sample().cpu_seconds > before.cpu_seconds
