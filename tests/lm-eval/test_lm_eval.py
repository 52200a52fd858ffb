"""lm-eval's ``local-completions`` model against a real ``rlt-server serve`` on loopback (the demo
model, fp32), on two tiny local tasks shipped next to this file: a multiple-choice task
(``loglikelihood``) and a perplexity task (``loglikelihood_rolling``). Every score lm-eval reports
equals the one computed offline from the engine's own prompt logprobs — with the Hugging Face
tokenizer loaded from the model directory, and with ``tokenizer_backend=remote`` (``/tokenizer_info``,
``/tokenize``).

Runs in the ``lmeval`` hatch environment (lm-eval and transformers are heavy, and need no torch of
their own); nothing is downloaded: the tasks' data are local JSON lines.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")  # the lmeval hatch env installs it; elsewhere this file is not collected

from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from rlt.platform import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

HERE = Path(__file__).resolve().parent
TASKS = HERE / "tasks"
_spec = importlib.util.spec_from_file_location("serve_fixtures", HERE.parent / "integration" / "serve" / "conftest.py")
serve_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve_fixtures)
launch_server = serve_fixtures.launch_server  # the HTTP tests' real-server fixture


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    import os

    from rlt.platform.checkpoint.demo import DEMO_NAME, demo_model_dir

    os.environ["RLT_DEMO_DIR"] = str(tmp_path_factory.mktemp("demo") / "demo")
    os.environ["HF_DATASETS_CACHE"] = str(tmp_path_factory.mktemp("hf-datasets"))
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    return DEMO_NAME, demo_model_dir()


@pytest.fixture(scope="module")
def server(launch_server, demo):
    return launch_server("--model", str(demo[1]), "--served-model-name", demo[0], "--dtype", "float32",
                         "--log-level", "warning")


@pytest.fixture(scope="module")
def engine(demo):
    return LLMEngine(EngineConfig(model=str(demo[1]), dtype="float32"))


def offline_loglikelihood(engine, context_enc: list[int], continuation_enc: list[int]) -> float:
    """Sum of the engine's prompt logprobs over the continuation's tokens."""
    ids = context_enc + continuation_enc
    engine.add_request("ll", ids, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.finished), out)
    return sum(e.logprob for e in out.prompt_logprobs[len(context_enc):])


def _evaluate(monkeypatch, server, demo, backend: str):
    monkeypatch.chdir(TASKS)  # the tasks' data_files are relative
    model_args = {"model": demo[0], "base_url": f"{server.url}/v1/completions", "tokenizer_backend": backend,
                  "max_retries": 1, "num_concurrent": 1}
    if backend == "huggingface":
        model_args["tokenizer"] = str(demo[1])
    lm = lm_eval.api.registry.get_model("local-completions").create_from_arg_string(
        ",".join(f"{k}={v}" for k, v in model_args.items()))
    results = lm_eval.simple_evaluate(model=lm, tasks=["rlt_tiny_mc", "rlt_tiny_ppl"], log_samples=True,
                                      task_manager=TaskManager(include_path=str(TASKS)))
    return lm, results


def _docs(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS / f"{name}.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("backend", ["huggingface", "remote"])
def test_scores_equal_the_engines_prompt_logprobs(monkeypatch, server, demo, engine, backend):
    lm, results = _evaluate(monkeypatch, server, demo, backend)

    # multiple choice: each choice's loglikelihood, then accuracy
    mc = sorted(results["samples"]["rlt_tiny_mc"], key=lambda s: s["doc_id"])
    docs = _docs("rlt_tiny_mc")
    assert len(mc) == len(docs)
    correct = 0
    for sample, doc in zip(mc, docs):
        got = [float(r[0]) for r in sample["filtered_resps"]]
        want = [offline_loglikelihood(engine, *lm._encode_pair(doc["question"], " " + c)) for c in doc["choices"]]
        assert got == pytest.approx(want, abs=1e-4)
        assert all(v < 0 for v in got)  # scored, not the 0.0 of missing logprobs
        correct += max(range(len(want)), key=want.__getitem__) == doc["answer"]
    assert results["results"]["rlt_tiny_mc"]["acc,none"] == pytest.approx(correct / len(docs))

    # perplexity: rolling windows from the eos prefix token, as lm-eval builds them
    ppl = sorted(results["samples"]["rlt_tiny_ppl"], key=lambda s: s["doc_id"])
    texts = [d["text"] for d in _docs("rlt_tiny_ppl")]
    total_ll, words = 0.0, 0
    for sample, text in zip(ppl, texts):
        windows = map(make_disjoint_window, get_rolling_token_windows(
            lm.tok_encode(text), lm.prefix_token_id, lm.max_length - 1, 1))
        want = sum(offline_loglikelihood(engine, ctx, cont) for ctx, cont in windows)
        got = float(sample["filtered_resps"][0]) if not isinstance(sample["filtered_resps"][0], list) \
            else float(sample["filtered_resps"][0][0])
        assert got == pytest.approx(want, abs=1e-4) and got < 0
        total_ll += want
        words += len(text.split())  # lm-eval's word count for word_perplexity
    word_ppl = results["results"]["rlt_tiny_ppl"]["word_perplexity,none"]
    assert word_ppl == pytest.approx(math.exp(-total_ll / words), rel=1e-4) and word_ppl > 1.0
