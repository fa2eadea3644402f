"""``sbpflow generate``: sampling (greedy, temperature, top-k) and text from a trained checkpoint, the
same under tensor parallelism as on one rank."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

import sbpflow as sf
from sbpflow.checkpoint.read import read_logical, resolve
from sbpflow.client.cli.generate import Sampling, Where, _cached, _windowed, generate, next_token, stream
from sbpflow.client.cli.main import main
from sbpflow.oracle import reference
from tests.examples.test_examples import load

SMALL = {"layers": 1, "heads": 2, "width": 16, "seq_len": 8}


def test_greedy_and_top_one_take_the_likeliest_and_top_k_draws_only_from_the_k() -> None:
    rng = np.random.default_rng(0)
    logits = np.array([0.1, 3.0, 2.0, -1.0, 2.5])
    assert next_token(logits, Sampling(temperature=0), rng) == 1
    assert {next_token(logits, Sampling(temperature=5.0, top_k=1), rng) for _ in range(20)} == {1}
    drawn = {next_token(logits, Sampling(temperature=10.0, top_k=3), rng) for _ in range(300)}
    assert drawn == {1, 2, 4}
    assert len({next_token(logits, Sampling(temperature=10.0), rng) for _ in range(300)}) == 5


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("temperature", -1.0, "temperature=-1.0"),
        ("top_k", -2, "top_k=-2"),
        ("max_new_tokens", 0, "at least one"),
    ],
)
def test_bad_sampling_settings_are_named(field: str, value: float, words: str) -> None:
    with pytest.raises(sf.SbpflowError, match=words):
        Sampling(**{field: value})


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("charlm")
    job = load("charlm").make_job(ranks=1, batch_size=4, steps=2, **SMALL)
    job.config = dataclasses.replace(job.config, checkpoint_every=2)
    sf.run(job, backend="inprocess", checkpoint_dir=str(root))
    return root


def test_greedy_text_is_the_models_likeliest_token_each_time_on_one_rank_and_under_tp(trained: Path) -> None:
    charlm = load("charlm")
    prompt = charlm.encode("def ")
    greedy = Sampling(max_new_tokens=3, temperature=0)
    model, where, sbp = _model(charlm, 1, False)
    one = generate(model, prompt, greedy, str(trained), where, sbp)
    model, where, sbp = _model(charlm, 2, True)
    tp = generate(model, prompt, greedy, str(trained), where, sbp)
    assert one[: len(prompt)] == prompt and len(one) == len(prompt) + 3 and tp == one
    # every new token, from the oracle on the checkpoint's values: a forward of the context each time
    from tests.control_plane.launch.test_run_outputs import Logits

    values = read_logical(resolve(trained))
    for n in range(len(prompt), len(one)):
        job = Logits(sf.nn.GPT(_model(charlm, 1, False)[0].config)).trace(
            sf.data.ArraySource(batch_size=1, arrays={"tokens": np.array([one[:n]])})
        )
        (name,) = job.fetches
        logits = reference.forward(job, fetches=[name], parameters=values)[name]
        assert one[n] == int(np.argmax(logits[0, -1]))


def test_a_batch_of_prompts_of_any_lengths_gives_each_the_tokens_it_gets_alone(trained: Path) -> None:
    charlm = load("charlm")
    prompts = [charlm.encode(t) for t in ("def ", "x", "return a + ")]  # the last is past the window
    sampling = Sampling(max_new_tokens=4, temperature=0)
    rows = [list(p) for p in prompts]
    model, where, sbp = _model(charlm, 1, False)
    for new in stream(model, prompts, sampling, str(trained), where, sbp):
        for row, t in zip(rows, new, strict=True):
            row.append(t)
    for p, row in zip(prompts, rows, strict=True):
        model, where, sbp = _model(charlm, 1, False)
        assert generate(model, p, sampling, str(trained), where, sbp) == row
    with pytest.raises(sf.SbpflowError, match="a prompt is empty"):
        next(stream(model, [[1], []], sampling, None, where, sbp))


def _model(charlm, ranks: int, tp: bool):  # type: ignore[no-untyped-def]
    model, where, sbp = charlm.make_model(ranks=ranks, tp=tp, **SMALL)
    return model, where, sbp


def test_the_command_prints_the_prompt_and_its_continuation(
    trained: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sets = [f"--set={k}={v}" for k, v in SMALL.items() if k != "layers"]
    args = [
        "generate",
        "examples/charlm.py",
        "--checkpoint",
        str(trained),
        "--prompt",
        "def ",
        "--top-k",
        "5",
    ]
    assert main([*args, "--max-new-tokens", "4", "--layers", "1", *sets]) == 0
    text = capsys.readouterr().out
    assert text.startswith("def ") and len(text.rstrip("\n")) == 8
    assert main([*args, "--prompt", "x", "--max-new-tokens", "2", "--layers", "1", *sets]) == 0
    text = capsys.readouterr().out  # a batch: each prompt's text on its line (a new line may be text)
    assert text.startswith("def ") and text[6:8] == "\nx" and len(text) == 6 + 1 + 3 + 1
    with pytest.raises(SystemExit):
        main([*args[:3], "--prompt", "x"])  # --checkpoint is required
    assert main(["generate", "examples/mlp.py", "--checkpoint", str(trained)]) == 2  # no make_model


@pytest.mark.parametrize(("ranks", "tp"), [(1, False), (2, True)])
def test_the_kv_cache_in_the_plan_gives_the_tokens_of_a_whole_forward_a_token(
    trained: Path, ranks: int, tp: bool
) -> None:
    charlm = load("charlm")
    prompts = [charlm.encode(t) for t in ("de", "x")]  # of two lengths: the rows draw at different steps
    for sampling in (
        Sampling(max_new_tokens=5, temperature=0),
        Sampling(5, temperature=2.0, top_k=4, seed=1),
    ):
        got = {}
        for path in (_cached, _windowed):
            model, where, sbp = _model(charlm, ranks, tp)
            got[path] = list(
                path(model, [list(p) for p in prompts], sampling, Where(str(trained), where, sbp))
            )
        assert got[_cached] == got[_windowed] and len(got[_cached]) == 5


def test_a_checkpoint_without_a_parameter_of_the_model_is_refused_on_the_cached_path(
    trained: Path, tmp_path: Path
) -> None:
    from sbpflow.checkpoint.format import write_safetensors

    values = read_logical(resolve(trained))
    write_safetensors(tmp_path / "part.safetensors", {n: v for n, v in values.items() if "ln_f" not in n})
    model, where, sbp = _model(load("charlm"), 1, False)
    with pytest.raises(sf.SbpflowError, match="ln_f"):
        generate(model, [1, 2], Sampling(max_new_tokens=2), str(tmp_path / "part.safetensors"), where, sbp)


def test_generate_from_a_job_on_a_server_needs_no_shared_disk(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sbpflow.client.client import Client
    from sbpflow.control_plane.service.server import ControlPlane, ServerConfig
    from sbpflow.runs.options import MANAGER_DEFAULTS

    root = tmp_path / "server-ckpts"
    cfg = ServerConfig(
        store=str(tmp_path / "jobs.db"),
        run=MANAGER_DEFAULTS.replace(backend="inprocess"),
        slots=1,
        http_port=None,
        checkpoint_root=str(root),
        data_roots=(str(sf.corpus.cache_dir()),),  # charlm's text: the corpus cache
    )
    plane = ControlPlane(cfg).start()
    try:
        job = load("charlm").make_job(ranks=1, batch_size=4, steps=2, **SMALL)
        job.config = dataclasses.replace(job.config, checkpoint_every=2)
        with Client(plane.address) as c:
            h = c.submit(job)
            assert h.wait(120).state == 5  # SUCCEEDED
        sets = [f"--set={k}={v}" for k, v in SMALL.items() if k != "layers"]
        common = ["--temperature", "0", "--max-new-tokens", "4", "--layers", "1", *sets]
        assert (
            main(["generate", "examples/charlm.py", "--job", h.job_id, "--address", plane.address, *common])
            == 0
        )
        streamed = capsys.readouterr().out
        assert main(["generate", "examples/charlm.py", "--checkpoint", str(root / h.job_id), *common]) == 0
        assert streamed == capsys.readouterr().out and len(streamed.rstrip("\n")) == 8
    finally:
        plane.stop()
