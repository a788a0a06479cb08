"""The task contract: loading factories, checking what they return, and the built-in task."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from repo_paths import HELPERS

from amped.cli.errors import UsageError
from amped.tasks.factory import load_factory
from amped.tasks.task import Task, as_task, call_model, count_samples, to_device
from amped.tasks.tiny_gpt import CORPUS_FILES, SEQ_LEN, VOCAB, TinyGPT, build, load_corpus

FACTORIES = HELPERS / "cli_factories.py"
CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "spec",
    [f"{FACTORIES}:good", "cli_factories:good", "amped.tasks.tiny_gpt:build"],
    ids=["file", "module", "package"],
)
def test_factory_specs_resolve(spec):
    factory = load_factory(spec)
    task = factory.build(batch_size=4, seed=0, device=CPU)
    assert isinstance(task, Task)
    inputs, _ = next(iter(task.batches))
    assert count_samples(inputs) == 4


def test_factory_gets_only_the_arguments_it_declares(monkeypatch):
    seen = {}

    def takes_seed(seed):
        seen["seed"] = seed
        model = torch.nn.Linear(2, 2)
        return model, [(torch.zeros(3, 2), torch.zeros(3, dtype=torch.long))], lambda o, t: o.sum()

    def takes_all(**kwargs):
        seen.update(kwargs)
        return takes_seed(kwargs["seed"])

    import cli_factories

    monkeypatch.setattr(cli_factories, "takes_seed", takes_seed, raising=False)
    monkeypatch.setattr(cli_factories, "takes_all", takes_all, raising=False)
    load_factory("cli_factories:takes_seed").build(batch_size=None, seed=5, device=CPU)
    assert seen == {"seed": 5}
    load_factory("cli_factories:takes_all").build(batch_size=8, seed=6, device=CPU)
    assert seen == {"seed": 6, "batch_size": 8, "device": CPU}


def test_tuple_task_is_named_after_its_factory():
    task = load_factory(f"{FACTORIES}:good").build(batch_size=None, seed=0, device=CPU)
    assert task.name == "cli_factories:good"
    named = load_factory(f"{FACTORIES}:with_task").build(batch_size=None, seed=0, device=CPU)
    assert named.name == "tiny-classifier"


def test_task_checks_name_the_contract():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(UsageError, match=r"an iterable of \(inputs, targets\)"):
        as_task((model, torch.zeros(3), torch.sum), "f")
    with pytest.raises(UsageError, match="callable loss_fn"):
        as_task((model, [(1, 2)], "mse"), "f")
    with pytest.raises(UsageError, match="batches from f are empty"):
        as_task((model, [], torch.sum), "f")
    with pytest.raises(UsageError, match="no floating-point parameters"):
        as_task((torch.nn.ReLU(), [(torch.zeros(1), 1)], torch.sum), "f")
    with pytest.raises(UsageError, match="inputs of each batch"):
        as_task((model, [("text", 1)], torch.sum), "f")


def test_inputs_may_be_a_tensor_a_tuple_or_a_dict():
    class Two(torch.nn.Module):
        def forward(self, a, b):
            return a + b

    a, b = torch.ones(3, 2), torch.ones(3, 2)
    assert count_samples((a, b)) == 3 and count_samples({"a": a, "b": b}) == 3
    assert torch.equal(call_model(Two(), (a, b)), call_model(Two(), {"a": a, "b": b}))
    moved = to_device({"x": [a, (b, 1)]}, CPU)
    assert moved["x"][1][1] == 1 and moved["x"][0] is not None


def test_corpus_is_the_standard_library_split_per_file():
    corpus = load_corpus()
    assert load_corpus().sha256 == corpus.sha256  # the same text every time
    assert set(corpus.files) <= set(CORPUS_FILES) and len(corpus.files) >= 10
    share = len(corpus.held_out) / (len(corpus.train) + len(corpus.held_out))
    assert 0.08 < share < 0.12
    assert int(corpus.train.max()) < VOCAB


def test_corpus_without_the_standard_library_says_what_to_do(tmp_path):
    with pytest.raises(RuntimeError, match="--model module:factory"):
        load_corpus(tmp_path)


def test_default_batches_are_fixed_by_the_seed():
    def first(seed):
        return next(iter(build(batch_size=4, seed=seed).batches))

    (x0, y0), (x1, _), (x2, _) = first(0), first(0), first(1)
    assert x0.shape == (4, SEQ_LEN) and torch.equal(x0[:, 1:], y0[:, :-1])
    assert torch.equal(x0, x1) and not torch.equal(x0, x2)


def test_default_model_is_causal():
    torch.manual_seed(0)
    model = TinyGPT().eval()
    tokens = torch.randint(0, VOCAB, (2, SEQ_LEN))
    changed = tokens.clone()
    changed[:, 40:] = (changed[:, 40:] + 1) % VOCAB
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert before.shape == (2, SEQ_LEN, VOCAB)
    torch.testing.assert_close(before[:, :40], after[:, :40], rtol=0, atol=0)
    assert not torch.equal(before[:, 40:], after[:, 40:])


def test_default_task_evaluates_held_out_loss_and_accuracy():
    task = build(batch_size=64, seed=0)
    assert task.evaluate is not None
    metrics = task.evaluate(lambda x: task.model(x))
    assert set(metrics) == {"loss", "accuracy"}
    assert abs(metrics["loss"] - torch.log(torch.tensor(float(VOCAB)))) < 1.0  # untrained
    assert 0.0 <= metrics["accuracy"] < 0.2


@pytest.mark.slow
def test_task_modules_need_no_cli_extra():
    code = (
        "import sys, amped.tasks.tiny_gpt, amped.tasks.factory; "
        "print(sorted(m for m in ('rich', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
