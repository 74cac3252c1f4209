"""hal inside SGLang's real engine and server, end to end, on the CPU (``tox -e sglang-engine``).

A small random-weight Llama (``ci/sglang_model.py``: fp32, GQA, a WordLevel tokenizer with a chat
template, made offline) is served by ``sglang.Engine(device="cpu", attention_backend=...)`` with
SGLang's ``torch_native`` and with ``hal`` (found through hal's plugin entry point alone), on one
request load: prompts of 1 to ~330 tokens, some sharing a long prefix (SGLang's radix cache serves
it), arriving while others decode (continuous batching), prefilled in chunks of 64 tokens. Greedy
tokens must be identical, and equal to transformers' ``generate``. Then ``python -m
sglang.launch_server --attention-backend hal`` answers SGLang's ``/generate`` and the OpenAI
``/v1/completions`` and ``/v1/chat/completions`` over HTTP with the engine's tokens, and is stopped
by its process id. A DeepSeek-V3 model (latent attention over SGLang's ``MLATokenToKVPool``) serves
the same load on hal and must equal transformers (SGLang's ``torch_native`` cannot run it on the CPU).
gpt-oss: SGLang refuses any attention backend outside a list of names for it (one assertion,
docs/sglang.md); the test checks that refusal, then serves gpt-oss on hal with only that assertion
bypassed (``sglang_engine.bypass_gpt_oss_allow_list``, marked as a test-only bypass) against transformers.
As deployments run it: tp 2 (and page size 16 where the release's paged allocator runs on the CPU)
against ``torch_native`` at the same settings. An fp8_e4m3 KV cache (SGLang's CPU engine refuses it for every
backend but ``intel_amx``: that one check bypassed, test-only, docs/sglang.md) against hal's fp8 reference in
transformers.

Each engine runs in its own Python (``ci/sglang_engine.py``), with ``SGLANG_USE_CPU_ENGINE=1`` and
the stand-ins of ``ci/sglang_stubs``. A minute or two per engine start on a loaded 2-core machine.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import pathlib
import random
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "ci"))

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None, reason="SGLang is not installed (tox -e sglang-engine)"
)

import sglang_engine  # noqa: E402
import sglang_model  # noqa: E402

SEED = 1234
VOCAB = 512
CHUNK = 64  # chunked_prefill_size: the long prompts prefill in several chunks
# A bounded KV pool: on the CPU SGLang otherwise sizes it from the machine's memory (13 GB on a 23 GB box).
ENGINE_ARGS = {"chunked_prefill_size": CHUNK, "max_total_tokens": 8192}
KEEP = {"skip_special_tokens": False}  # a random model may generate <unk> or </s>: keep them in the text
SERVER_CHAT = [{"role": "system", "content": "w3 w1 w4"}, {"role": "user", "content": "w1 w5 w9 w2 w6"}]


def _requests(chat_ids: list[int]) -> list[dict]:
    """Varied lengths, a shared 150-token prefix (first alone, then with suffixes once it is cached), a
    repeated prompt, the chat prompt the server test sends; staggered so requests join running batches."""
    rng = random.Random(SEED)
    low = len(sglang_model.SPECIALS)

    def ids(n):
        return [rng.randrange(low, VOCAB) for _ in range(n)]

    prefix = ids(150)
    prompts = [ids(1), ids(7), ids(33), prefix, ids(200), ids(330)]
    prompts += [prefix + ids(n) for n in (1, 17, 70)]
    prompts += [prompts[2], chat_ids]
    requests = []
    for i, prompt in enumerate(prompts):
        delay = 0.0 if i < 4 else 1.5 + 0.4 * (i - 4)  # the prefix's first request is done before its sharers
        requests.append({"input_ids": prompt, "max_new_tokens": 8 + 3 * (i % 5), "delay_s": delay})
    return requests


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    return str(
        sglang_model.build_model(str(path), layers=3, hidden=96, heads=6, kv_heads=2, vocab_size=VOCAB, seed=SEED)
    )


@pytest.fixture(scope="module")
def tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


@pytest.fixture(scope="module")
def workload(tokenizer):
    chat_ids = tokenizer.apply_chat_template(SERVER_CHAT, add_generation_prompt=True, tokenize=True)
    chat_ids = list(chat_ids if isinstance(chat_ids, list) else chat_ids["input_ids"])  # a BatchEncoding in 5.x
    return _requests(chat_ids)


@pytest.fixture(scope="module")
def engines(model, workload, tmp_path_factory):
    work = tmp_path_factory.mktemp("engine")
    extra = ENGINE_ARGS
    # Page size 1: SGLang 0.5.21's paged KV allocator (mem_cache/allocator/paged.py) launches Triton kernels
    # whatever the backend, so its CPU engine runs at page size 1 (hal's pages > 1 are covered by the kit).
    return {
        backend: sglang_engine.run_in_subprocess(model, backend, workload, str(work), extra)
        for backend in ("torch_native", "hal")
    }


def _outputs(run: dict) -> list[list[int]]:
    return [r["output_ids"] for r in run["results"]]


def test_hal_engine_tokens_equal_torch_native(engines, workload):
    hal_out, ref_out = _outputs(engines["hal"]), _outputs(engines["torch_native"])
    assert [len(o) for o in hal_out] == [r["max_new_tokens"] for r in workload]
    for i, (got, want) in enumerate(zip(hal_out, ref_out)):
        assert got == want, f"request {i} ({len(workload[i]['input_ids'])} prompt tokens): hal {got} != {want}"


def _assert_equals_transformers(model: str, workload: list[dict], outputs: list[list[int]], **hf_args) -> None:
    """Each request's greedy tokens equal transformers' ``generate`` on the same checkpoint, in fp32 (``hf_args``:
    more ``from_pretrained`` arguments, e.g. ``attn_implementation``)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, **hf_args).eval()
    for i, (request, got) in enumerate(zip(workload, outputs)):
        n = request["max_new_tokens"]
        ids = torch.tensor([request["input_ids"]])
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None)
        assert got == out[0, ids.shape[1] :].tolist(), f"request {i} ({ids.shape[1]} prompt tokens)"


def test_engine_tokens_equal_transformers(engines, workload, model):
    _assert_equals_transformers(model, workload, _outputs(engines["hal"]))


def _assert_prefix_cache_hits(run: dict) -> None:
    """The shared prefix's later requests (6..8) found its 150 tokens in SGLang's radix cache (whole pages of
    them: 144 at page size 16)."""
    page = run["engine_args"].get("page_size") or 1
    cached = [r["cached_tokens"] for r in run["results"]]
    assert sum(c >= 150 // page * page for c in cached[6:9]) >= 2, cached


# ----------------------------------------------------------------------------- as deployments run it


def _deployment_args() -> dict:
    """Tensor parallel 2, and page size 16 where the installed SGLang's paged allocator runs on the CPU engine
    (0.5.23; not 0.5.21, whose allocator launches a Triton kernel: sglang_engine.paged_allocator_runs_on_cpu)."""
    paged = {"page_size": 16} if sglang_engine.paged_allocator_runs_on_cpu() else {}
    return {**ENGINE_ARGS, "tp_size": 2, **paged}


@pytest.fixture(scope="module")
def deployed(model, workload, tmp_path_factory):
    """The load on ``torch_native`` and on ``hal`` with tp 2 (and page 16 where the release allows it), prefix
    caching and chunked prefill on, as ENGINE_ARGS."""
    work = str(tmp_path_factory.mktemp("deployed"))
    extra = _deployment_args()
    return {
        backend: sglang_engine.run_in_subprocess(
            model, backend, workload, work, extra, tag="deployed", env=sglang_engine.TP2_ENV
        )
        for backend in ("torch_native", "hal")
    }


def test_tp2_and_page16_tokens_equal_torch_native_at_the_same_settings(deployed, workload):
    hal_run, ref_run = deployed["hal"], deployed["torch_native"]
    assert hal_run["engine_args"]["tp_size"] == 2 and hal_run["engine_args"] == {
        **ref_run["engine_args"],
        "attention_backend": "hal",
    }
    hal_out, ref_out = _outputs(hal_run), _outputs(ref_run)
    assert [len(o) for o in hal_out] == [r["max_new_tokens"] for r in workload]
    for i, (got, want) in enumerate(zip(hal_out, ref_out)):
        assert got == want, f"request {i} ({len(workload[i]['input_ids'])} prompt tokens): hal {got} != {want}"
    _assert_prefix_cache_hits(hal_run)


def test_deepseek_mla_on_hal_equals_transformers(workload, tmp_path):
    """DeepSeek-V3's latent attention (MLA, yarn rope) in SGLang's engine on hal, over SGLang's
    ``MLATokenToKVPool`` in place, on the same load (chunked prefill, prefix-cache hits, continuous
    batching): tokens equal transformers'. SGLang's ``torch_native`` cannot run this model on the CPU
    (docs/sglang.md: its MHA prefill path over the latent pool), so transformers is the reference."""
    path = sglang_model.build_model(
        str(tmp_path / "deepseek"), arch="deepseek", layers=2, hidden=64, heads=4, vocab_size=VOCAB, seed=SEED + 1
    )
    run = sglang_engine.run_in_subprocess(path, "hal", workload, str(tmp_path), ENGINE_ARGS)
    assert [len(o) for o in _outputs(run)] == [r["max_new_tokens"] for r in workload]
    _assert_prefix_cache_hits(run)
    _assert_equals_transformers(path, workload, _outputs(run))


def test_engine_load_exercised_what_it_claims(engines, workload):
    run = engines["hal"]
    results = run["results"]
    _assert_prefix_cache_hits(run)
    # continuous batching: a later request was sent while an earlier one was still decoding
    spans = [(r["sent_s"], r["sent_s"] + r["latency_s"]) for r in results]
    assert any(a[0] < b[0] < a[1] for a in spans for b in spans if a is not b), spans
    # chunked prefill: prompts longer than the chunk were served
    assert max(len(r["input_ids"]) for r in workload) > 4 * CHUNK
    assert run["engine_args"]["attention_backend"] == "hal" and run["engine_args"]["chunked_prefill_size"] == CHUNK


def _words_to_ids(tokenizer, text: str) -> list[int]:
    """The tokenizer is one word per token, special tokens included (the server is asked to keep them)."""
    return tokenizer.convert_tokens_to_ids(text.split())


def test_server_over_http(model, workload, engines, tokenizer, tmp_path):
    # by request: the load repeats a prompt with another max_new_tokens
    expected = {id(r): out for r, out in zip(workload, _outputs(engines["torch_native"]))}
    process, url = sglang_engine.start_server(model, "hal", str(tmp_path / "server.log"), ENGINE_ARGS)
    try:
        jobs = []
        for r in workload[:6]:  # /generate: text in, ids out
            text = tokenizer.decode(r["input_ids"])
            body = {
                "text": text,
                "sampling_params": {
                    "max_new_tokens": r["max_new_tokens"],
                    "temperature": 0,
                    "ignore_eos": True,
                    **KEEP,
                },
            }
            jobs.append(("generate", r, body))
        for r in workload[6:9]:  # /v1/completions: token ids in, text out
            body = {
                "model": model,
                "prompt": r["input_ids"],
                "max_tokens": r["max_new_tokens"],
                "temperature": 0,
                "ignore_eos": True,
                **KEEP,
            }
            jobs.append(("completions", r, body))
        chat = workload[-1]
        body = {
            "model": model,
            "messages": SERVER_CHAT,
            "max_tokens": chat["max_new_tokens"],
            "temperature": 0,
            "ignore_eos": True,
            **KEEP,
        }
        jobs.append(("chat", chat, body))
        paths = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:  # concurrent clients
            answers = list(pool.map(lambda job: sglang_engine.post(url + paths[job[0]], job[2]), jobs))
        for (kind, request, _), answer in zip(jobs, answers):
            want = expected[id(request)]
            if kind == "generate":
                got = answer["output_ids"]
                assert _words_to_ids(tokenizer, answer["text"]) == got
            elif kind == "completions":
                got = _words_to_ids(tokenizer, answer["choices"][0]["text"])
            else:
                got = _words_to_ids(tokenizer, answer["choices"][0]["message"]["content"])
                assert answer["usage"]["prompt_tokens"] == len(request["input_ids"])
            assert got == want, f"{kind}: {got} != {want}"
    finally:
        sglang_engine.stop_server(process)
    assert process.returncode is not None


# ----------------------------------------------------------------------------- fp8 KV cache


def _fp8_kv_attention(name: str):
    """A transformers attention function whose K and V are what hal's KV-dtype table stores for ``name`` and reads
    back (``hal.kv_dtypes.kv_dtype(name)``: quantise with the layer's scale, 1.0 for a checkpoint without scales
    as SGLang defaults it, then dequantise), before transformers' own SDPA in fp32: hal's fp8 reference
    (``hal.kernels.reference``: attention over the dequantised fp8 entries, queries and outputs in the model's
    dtype) inside transformers' model. Re-quantising the cached past each step is exact (fp8 values round-trip)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import hal

    row = hal.kv_dtypes.kv_dtype(name)

    def attention(module, query, key, value, attention_mask, **kwargs):
        key, value = (row.dequantize(row.quantize(x), dtype=x.dtype) for x in (key, value))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    return attention


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3"])
def test_fp8_kv_cache_on_hal_equals_hals_fp8_reference(model, workload, tmp_path, kv_cache_dtype):
    """``--kv-cache-dtype fp8_e4m3`` in SGLang's CPU engine on hal (its ``cpu_fp8_e4m3`` pool: float8 entries,
    the layers' scales, page size 16 where the release's paged allocator runs on the CPU), with prefix caching
    and chunked prefill, against hal's fp8 reference in transformers (:func:`_fp8_kv_attention`): identical
    greedy tokens, while the same model with an fp32 cache answers differently (the load is sensitive to fp8).

    SGLang refuses an fp8 cache on the CPU engine for any backend but ``intel_amx`` (checked first); the run
    bypasses only that check (TEST-ONLY: ``sglang_engine.bypass_cpu_fp8_kv_refusal``, docs/sglang.md).
    fp8_e5m2 is refused earlier on the CPU (``kv_cache_dtype.py``) and not bypassed."""
    from transformers import AttentionInterface

    paged = {"page_size": 16} if sglang_engine.paged_allocator_runs_on_cpu() else {}
    extra = {**ENGINE_ARGS, **paged, "kv_cache_dtype": kv_cache_dtype}
    with pytest.raises(RuntimeError, match="CPU FP8 KV cache requires"):
        sglang_engine.run_in_subprocess(model, "hal", workload[:1], str(tmp_path), extra, tag="refused")
    run = sglang_engine.run_in_subprocess(model, "hal", workload, str(tmp_path), extra, bypass=("cpu-fp8-kv",))
    assert run["engine_args"]["kv_cache_dtype"] == kv_cache_dtype
    outputs = _outputs(run)
    assert [len(o) for o in outputs] == [r["max_new_tokens"] for r in workload]
    _assert_prefix_cache_hits(run)
    name = f"hal_{kv_cache_dtype}_kv"
    AttentionInterface.register(name, _fp8_kv_attention(kv_cache_dtype))
    _assert_equals_transformers(model, workload, outputs, attn_implementation=name)
    with pytest.raises(AssertionError):  # an fp32 cache gives other tokens: the comparison can tell
        _assert_equals_transformers(model, workload, outputs)


# ----------------------------------------------------------------------------- speculative decoding


def test_ngram_speculative_decoding_on_hal_equals_transformers(model, workload, tmp_path):
    """``speculative_algorithm="NGRAM"`` (SGLang's draft-model-free speculator: drafts from an n-gram corpus of the
    requests' own tokens, verified as a tree) in SGLang's CPU engine on hal: hal serves the target's TARGET_VERIFY
    steps (SGLang's CPU QLEN_ONLY tree masks, integration's ``_VerifyInput``), and greedy speculative decoding
    must give exactly the non-speculative greedy tokens: transformers' ``generate`` (``torch_native`` cannot
    verify; the tp-1 test shows it equal to transformers on this load). Some drafts must be accepted, so the
    verify path really ran. SGLang's CPU-engine speculative ops come from sgl_kernel's CPU build, stood in for
    here by ``ci/sglang_stubs`` (EAGLE / standalone drafts are not runnable on hal: docs/sglang.md)."""
    extra = {**ENGINE_ARGS, "speculative_algorithm": "NGRAM"}
    # A random model's text has no n-grams of its own to draft from: two prompts asked again once their first
    # request has finished (its tokens are then in SGLang's corpus) give drafts the target accepts.
    requests = workload + [{**workload[i], "delay_s": 0.0, "after": i} for i in (1, 4)]
    run = sglang_engine.run_in_subprocess(model, "hal", requests, str(tmp_path), extra, tag="ngram")
    outputs = _outputs(run)
    assert [len(o) for o in outputs] == [r["max_new_tokens"] for r in requests]
    assert sum(r["spec_verify_ct"] for r in run["results"]) > 0, run["results"]
    assert sum(r["spec_num_correct_drafts"] for r in run["results"]) > 0, run["results"]
    _assert_equals_transformers(model, requests, outputs)


# ----------------------------------------------------------------------------- gpt-oss


def test_gpt_oss_on_hal_is_stopped_by_sglangs_allow_list_alone(workload, tmp_path):
    """SGLang refuses gpt-oss on any backend not *named* in its list (model_hook.py's assertion: hal is not, nor
    is torch_native). With that one assertion bypassed (TEST-ONLY: ``bypass_gpt_oss_allow_list``, nothing else of
    SGLang changed), SGLang's engine serves ``GptOssForCausalLM`` (attention sinks, sliding windows on alternate
    layers, MoE) on hal, and the greedy tokens equal transformers' ``generate``: one upstream line is all that
    stands between a deployment and gpt-oss on hal."""
    path = sglang_model.build_model(
        str(tmp_path / "gpt-oss"), arch="gpt-oss", layers=2, hidden=64, heads=4, vocab_size=VOCAB, seed=SEED + 2
    )
    requests = workload[:4] + workload[6:8]  # short and long prompts, the shared prefix, chunked prefills
    with pytest.raises(RuntimeError, match="GptOssForCausalLM requires one of .* attention backend"):
        sglang_engine.run_in_subprocess(path, "hal", requests, str(tmp_path), ENGINE_ARGS, tag="refused")
    run = sglang_engine.run_in_subprocess(
        path, "hal", requests, str(tmp_path), ENGINE_ARGS, tag="bypassed", bypass=("gpt-oss-allow-list",)
    )
    assert run["engine_args"]["attention_backend"] == "hal"
    assert [len(o) for o in _outputs(run)] == [r["max_new_tokens"] for r in requests]
    _assert_equals_transformers(path, requests, _outputs(run))
