"""Prefill/decode disaggregation: a prefill engine computes a prompt and holds its KV blocks; a decode engine
fetches the blocks it lacks over ZeroMQ and generates. The tokens are HF's, a fetch that fails only costs a
recompute, held blocks are bounded in time, and a peer without the key gets nothing."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import httpx
import msgpack
import pytest
import torch
import zmq

from services.worker import kv_transport
from services.worker.kv_transport import KVServer, fetch_blocks
from shared.kv_transfer_config import KVTransferConfig
from tests.conftest import metric_total, parse_metrics, serve, wait_until
from tests.engine_harness import Engine
from tests.test_end_to_end import MAX_TOKENS, prompts
from tests.tiny_models import hf_greedy, hf_lora_greedy, make_lora_adapter

BLOCK = 4
PROMPTS = [[11 + 3 * i + j for j in range(21)] for i in range(3)]  # five full blocks to fetch each, a token after


def producer_and_consumer(llama_dir: str, address: str, hold: float = 30.0) -> tuple[Engine, Engine]:
    producer = Engine(
        llama_dir,
        block_size=BLOCK,
        num_gpu_blocks=96,
        prefix_caching=True,
        kv_transfer=KVTransferConfig("kv_producer", address=address, hold_seconds=hold),
    )
    consumer = Engine(
        llama_dir, block_size=BLOCK, num_gpu_blocks=96, prefix_caching=True, kv_transfer=KVTransferConfig("kv_consumer")
    )
    return producer, consumer


def prefill(producer: Engine, prompt: list[int]):
    request_id = producer.add(prompt, max_tokens=1, ignore_eos=True, kv_send=True)
    producer.run()
    return request_id, producer.handoffs[request_id]


def test_decode_on_fetched_blocks_gives_hfs_tokens_and_both_sides_account_for_every_block(llama_dir, tmp_path):
    producer, consumer = producer_and_consumer(llama_dir, f"ipc://{tmp_path}/kv.sock")
    for prompt in PROMPTS:
        request_id, handoff = prefill(producer, prompt)
        assert handoff is not None and len(handoff.block_ids) == (len(prompt) - 1) // BLOCK
        assert producer.stats().blocks_held_for_fetch == len(handoff.block_ids)
        # The engine harness audits both managers' block accounting after every step.
        assert consumer.generate([prompt], max_tokens=MAX_TOKENS, kv_source=handoff) == [
            hf_greedy(llama_dir, prompt, MAX_TOKENS)
        ]
        assert producer.scheduler.kv_cache.remote.release(request_id)
        producer.run()  # the step that ends the export
    assert consumer.stats().blocks_fetched == sum((len(p) - 1) // BLOCK for p in PROMPTS)
    assert consumer.stats().num_prompt_tokens_computed == len(PROMPTS) * (1 + (len(PROMPTS[0]) - 1) % BLOCK)
    assert (
        producer.stats().blocks_held_for_fetch == 0
        and producer.stats().blocks_exported == consumer.stats().blocks_fetched
    )


def test_a_decode_engine_fetches_only_the_blocks_its_prefix_cache_lacks(llama_dir, tmp_path):
    producer, consumer = producer_and_consumer(llama_dir, f"ipc://{tmp_path}/kv.sock")
    shared, own = PROMPTS[0][:12], PROMPTS[1][:9]  # three blocks the consumer computes first, then two more
    consumer.generate([shared + [5]], max_tokens=1)
    _, handoff = prefill(producer, shared + own)
    assert consumer.generate([shared + own], max_tokens=MAX_TOKENS, kv_source=handoff) == [
        hf_greedy(llama_dir, shared + own, MAX_TOKENS)
    ]
    assert consumer.stats().blocks_fetched == 2


@pytest.mark.parametrize("fault", ["gone", "stalled", "other layout"])
def test_a_fetch_that_fails_is_computed_instead_and_the_tokens_stay_hfs(llama_dir, tmp_path, monkeypatch, fault):
    monkeypatch.setattr(kv_transport, "FETCH_TIMEOUT_SECONDS", 0.5)
    producer, consumer = producer_and_consumer(llama_dir, f"ipc://{tmp_path}/kv.sock")
    _, handoff = prefill(producer, PROMPTS[0])
    assert handoff is not None
    if fault == "gone":  # the prefill engine died after it computed the prompt
        producer.cache.remote.server.close()
    elif fault == "stalled":  # something answers at its address, never with blocks
        handoff.address = f"ipc://{tmp_path}/silent.sock"
        silent = zmq.Context.instance().socket(zmq.ROUTER)
        silent.bind(handoff.address)
    else:
        handoff.layout = "1x2x4x2x8:float16"
    assert consumer.generate([PROMPTS[0]], max_tokens=MAX_TOKENS, kv_source=handoff) == [
        hf_greedy(llama_dir, PROMPTS[0], MAX_TOKENS)
    ]
    stats = consumer.stats()
    assert stats.fetches_failed == 1 and stats.blocks_fetched == 0
    assert stats.num_prompt_tokens_computed == len(PROMPTS[0])


def test_blocks_no_decode_engine_releases_are_freed_after_the_hold_time(llama_dir, tmp_path):
    producer, _ = producer_and_consumer(llama_dir, f"ipc://{tmp_path}/kv.sock", hold=20.0)
    remote, now = producer.scheduler.kv_cache.remote, [0.0]
    remote.clock = lambda: now[0]
    prefill(producer, PROMPTS[0])
    assert producer.stats().blocks_held_for_fetch == 5 and remote.due_in() == 20.0
    now[0] = 19.9
    assert not remote.expire()
    now[0] = 20.0
    assert remote.expire()
    producer.run()
    assert producer.stats().blocks_held_for_fetch == 0 and producer.stats().holds_expired == 1


def server_with_one_export(tmp_path, secret: bytes | None) -> tuple[KVServer, torch.Tensor, str]:
    cache = torch.arange(2 * 2 * 6 * 4 * 3, dtype=torch.float32).view(2, 2, 6, 4, 1, 3)
    address = f"ipc://{tmp_path}/kv-{os.urandom(4).hex()}.sock"
    server = KVServer(cache, address, secret, zmq.Context.instance())
    server.export(b"t" * 16, [4, 1])
    return server, cache, address


def test_with_a_key_only_a_peer_holding_it_is_answered(tmp_path):
    secret = os.urandom(32)
    server, cache, address = server_with_one_export(tmp_path, secret)
    context = zmq.Context.instance()
    into = torch.zeros_like(cache)
    fetch_blocks(into, address, b"t" * 16, [0, 1], [0, 2], secret, context)
    assert torch.equal(into[:, :, 0], cache[:, :, 4]) and torch.equal(into[:, :, 2], cache[:, :, 1])
    for key in (None, os.urandom(32)):  # keyless, and a foreign key: no handshake, so no answer at all
        with pytest.raises(TimeoutError):
            fetch_blocks(torch.zeros_like(cache), address, b"t" * 16, [0], [0], key, context, timeout=0.5)
    server.close()


def test_without_the_token_a_peer_gets_no_block(tmp_path):
    server, cache, address = server_with_one_export(tmp_path, None)
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.connect(address)
    for request in ([b"x" * 16, [0]], [b"t" * 16, [7]], [b"t" * 16, []], "nonsense"):
        peer.send(msgpack.packb(request))
        assert peer.poll(2000)
        assert peer.recv_multipart() in ([b"unknown"], [b"bad"])
    server.end(b"t" * 16)
    peer.send(msgpack.packb([b"t" * 16, [0]]))
    assert peer.poll(2000) and peer.recv_multipart() == [b"unknown"]
    peer.close(linger=0)
    server.close()


def test_the_config_takes_vllms_json_and_refuses_what_it_cannot_serve():
    config = KVTransferConfig.parse(
        '{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_ip": "10.0.0.2", "kv_port": 6000,'
        ' "kv_connector_extra_config": {"key_file": "/k"}}'
    )
    assert config is not None and config.produces and config.consumes and config.endpoint == "tcp://10.0.0.2:6000"
    assert KVTransferConfig.parse(config.to_json()) == config
    assert config.bind_endpoint == "tcp://*:6000"
    refused = [
        '{"kv_role": "prefill"}',
        '{"kv_role": "kv_producer", "kv_port": 0}',
        '{"kv_role": "kv_producer", "kv_connector": "MooncakeConnector"}',
        "[1]",
        '{"kv_role": "kv_consumer", "colour": 1}',
        '{"kv_role": "kv_producer", "kv_port": 6000}',  # over tcp:// without a key file
    ]
    for bad in refused:
        with pytest.raises(ValueError, match="--kv-transfer-config"):
            KVTransferConfig.parse(bad)


# --- through the services: `pagedserve up --pd 1:1` ---------------------------------------------------


@pytest.fixture(scope="module")
def pd_server(llama_dir, tmp_path_factory):
    adapter = make_lora_adapter(llama_dir, str(tmp_path_factory.mktemp("adapter")), rank=4, seed=3)
    ngram = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "adaptive": False})
    flags = ["--pd", "1:1", "--block-size", "8", "--speculative-config", ngram, "--enable-lora"]
    with serve(llama_dir, str(tmp_path_factory.mktemp("pd")), *flags, "--lora-modules", f"sql={adapter}") as server:
        server.adapter = adapter
        base = int(server.metrics_urls["scheduler"].rsplit(":", 1)[1].split("/")[0])
        server.engine_metrics = {role: f"http://127.0.0.1:{base + 10 * i}/metrics" for i, role in enumerate(("p", "d"))}
        yield server


def engine_metrics(server, role: str) -> dict[str, float]:
    return parse_metrics(httpx.get(server.engine_metrics[role], timeout=10).text)


def complete(server, prompt, **body) -> list[list[int]]:
    payload = {"model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = httpx.post(
        f"{server.base_url}/v1/completions", json=payload | body | {"return_token_ids": True}, timeout=120
    )
    response.raise_for_status()
    return [c["token_ids"] for c in sorted(response.json()["choices"], key=lambda c: c["index"])]


pytestmark_slow = pytest.mark.slow


@pytestmark_slow
def test_served_greedy_output_through_prefill_and_decode_is_hfs(pd_server, llama_dir):
    prompt_ids = prompts(llama_dir)
    sent_before = metric_total(engine_metrics(pd_server, "p"), "pagedserve_kv_transfer_blocks_total")
    assert complete(pd_server, prompt_ids) == [hf_greedy(llama_dir, p, MAX_TOKENS) for p in prompt_ids]
    produced, decoded = engine_metrics(pd_server, "p"), engine_metrics(pd_server, "d")
    received = decoded['pagedserve_kv_transfer_blocks_total{direction="received"}']
    assert received > 0 and produced['pagedserve_kv_transfer_blocks_total{direction="sent"}'] > sent_before
    assert wait_until(lambda: engine_metrics(pd_server, "p")["pagedserve_kv_transfer_held_blocks"] == 0, 10)


@pytestmark_slow
def test_n_samples_an_adapter_speculation_and_a_schema_work_on_the_decode_side(pd_server, llama_dir):
    prompt = prompts(llama_dir)[0]
    assert complete(pd_server, prompt, n=2) == [hf_greedy(llama_dir, prompt, MAX_TOKENS)] * 2
    assert complete(pd_server, prompt, model="sql") == [
        hf_lora_greedy(llama_dir, pd_server.adapter, prompt, MAX_TOKENS)
    ]
    looping = (prompt[:6] * 6)[:40]  # n-gram proposals find its repeats
    assert complete(pd_server, looping, max_tokens=24) == [hf_greedy(llama_dir, looping, 24)]
    # The decode engine verified proposals (a random model's tokens seldom repeat its prompt: few are accepted).
    assert metric_total(engine_metrics(pd_server, "d"), "pagedserve_spec_decode_num_draft_tokens_total") > 0
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    response = httpx.post(
        f"{pd_server.base_url}/v1/chat/completions",
        json={"model": pd_server.model, "messages": [{"role": "user", "content": "n?"}], "max_tokens": 40} | body,
        timeout=120,
    )
    response.raise_for_status()
    assert isinstance(json.loads(response.json()["choices"][0]["message"]["content"])["n"], int)


def role_pid(server, role: str, service: str) -> int:
    """The pid of this server's prefill (kv_producer) or decode (kv_consumer) engine's scheduler or worker (another
    test's server may run beside it)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read().decode(errors="replace")
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            mine = parent == server.process.pid
            if mine and f"services.{service}" in cmdline and f'"kv_role": "{role}"' in cmdline:
                return int(entry)
    raise LookupError(f"no {role} {service}")


@pytestmark_slow
def test_a_killed_decode_engine_ends_its_stream_with_an_error_in_seconds_and_frees_the_prefill_blocks(pd_server):
    worker = role_pid(pd_server, "kv_consumer", "worker")
    os.kill(worker, signal.SIGSTOP)  # it never finishes fetching: the prefill engine holds the blocks meanwhile
    answer: dict[str, object] = {}

    def stream() -> None:
        body = {"model": pd_server.model, "prompt": list(range(5, 60)), "max_tokens": 50, "stream": True}
        response = httpx.post(f"{pd_server.base_url}/v1/completions", json=body, timeout=60)
        answer["body"], answer["ended"] = response.text, time.monotonic()

    client = threading.Thread(target=stream)
    client.start()
    try:
        assert wait_until(lambda: engine_metrics(pd_server, "p")["pagedserve_kv_transfer_held_blocks"] > 0, 30)
        killed = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        client.join(30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGCONT)
    assert float(answer["ended"]) - killed < 5.0  # type: ignore[arg-type]
    assert "error" in str(answer["body"])
    assert wait_until(lambda: engine_metrics(pd_server, "p")["pagedserve_kv_transfer_held_blocks"] == 0, 5)
    assert wait_until(lambda: httpx.get(f"{pd_server.base_url}/health").status_code == 200, 120)


@pytestmark_slow
def test_the_first_token_comes_from_the_prefill_engine_once_and_seeded_samples_match_one_engines(
    pd_server, llama_server, llama_dir
):
    prompt = prompts(llama_dir)[1]
    seeded = {"temperature": 1.0, "seed": 7, "max_tokens": 12}
    assert complete(pd_server, prompt, **seeded) == complete(llama_server, prompt, **seeded)
    body = {"model": pd_server.model, "prompt": prompt, "stream": True, "return_token_ids": True} | seeded
    with httpx.stream("POST", f"{pd_server.base_url}/v1/completions", json=body, timeout=120) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    streamed = [t for chunk in chunks for choice in chunk["choices"] for t in choice.get("token_ids") or []]
    assert streamed == complete(llama_server, prompt, **seeded)[0]  # 12 tokens: the first one not twice
    # Unseeded, a decode engine that drew its own first token would part from the prefill engine's, which the api
    # answers with an error: every one of these comes whole.
    for _ in range(4):
        [tokens] = complete(pd_server, prompt, temperature=1.0, max_tokens=6)
        assert len(tokens) == 6
