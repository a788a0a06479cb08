"""amped's transformers Trainer against the Trainer's own mixed precision, the
hand-written loop, and the Trainer's checkpoints (scaler.pt and the recipe's state)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")
from accelerate.state import AcceleratorState  # noqa: E402
from integration_helpers import reset_accelerate_state  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments  # noqa: E402

import amped  # noqa: E402
from amped.integrations.transformers import RECIPE_STATE_NAME, Trainer  # noqa: E402

STEPS = 6
BATCH = 4


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    reset_accelerate_state()
    yield
    reset_accelerate_state()


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    return LlamaForCausalLM(config)


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32, (STEPS * BATCH, 8), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


class InOrder:
    """Batches in dataset order, and losses recorded per step, with optional overflows."""

    overflow_at: tuple[int, ...] = ()

    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        if self.state.global_step in self.overflow_at:
            loss = loss * float("inf")
        self.losses = [*getattr(self, "losses", []), loss.detach().clone()]
        return loss


class AmpedTrainer(InOrder, Trainer):
    pass


class TheirTrainer(InOrder, transformers.Trainer):
    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        if self.args.fp16:
            # Accelerate turns fp16 off on CPU (it trains in float32 there); its own fp16
            # path is switched on by hand, as its constructor does on a GPU.
            self.accelerator.native_amp = True
            self.accelerator.scaler = torch.amp.GradScaler("cpu")


def arguments(tmp_path, **kwargs) -> TrainingArguments:
    defaults = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
    )
    return TrainingArguments(**{**defaults, **kwargs})


def train(cls, tmp_path, resume=None, overflow_at=(), args=None, **kwargs):
    model = tiny_llama()
    trainer = cls(model=model, args=args or arguments(tmp_path), train_dataset=dataset(), **kwargs)
    trainer.overflow_at = overflow_at
    trainer.train(resume_from_checkpoint=resume)
    return trainer, [p.detach().clone() for p in model.parameters()]


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    ("recipe", "flag", "accumulate"),
    [("bf16-mixed", "bf16", 1), ("fp16-mixed", "fp16", 1), ("fp16-mixed", "fp16", 2)],
)
def test_trainer_matches_its_own_mixed_precision_bitwise(recipe, flag, accumulate, tmp_path):
    steps = {"gradient_accumulation_steps": accumulate, "max_steps": STEPS // accumulate}
    theirs = arguments(tmp_path, **{flag: True}, **steps)
    ref, ref_params = train(TheirTrainer, tmp_path, args=theirs)
    AcceleratorState._reset_state(True)
    ours, params = train(AmpedTrainer, tmp_path, args=arguments(tmp_path, **steps), recipe=recipe)
    assert _equal(ref.losses, ours.losses)
    assert _equal(ref_params, params)


def hand_loop(recipe):
    """The Trainer's run written by hand: AdamW (fused, as the Trainer's default) over
    its two parameter groups, the linear schedule, clipping at 1.0, batches in order."""
    model = tiny_llama()
    model.train()
    # The Trainer's two groups (decayed, not decayed), which set the order the
    # compensated optimizers step and draw random bits in.
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if n in decay]},
        {"params": [p for n, p in named if n not in decay]},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.0, fused=True)
    setup = amped.prepare(model, opt, recipe)
    sched = torch.optim.lr_scheduler.LambdaLR(setup.optimizer, lambda s: (STEPS - s) / STEPS)
    data = dataset()
    losses = []
    for step in range(STEPS):
        batch = data[step * BATCH : (step + 1) * BATCH]
        ids = torch.stack([b["input_ids"] for b in batch])
        with setup.autocast():
            loss = setup.model(input_ids=ids, labels=ids).loss.float()
        losses.append(loss.detach().clone())
        setup.backward(loss)
        setup.unscale_()  # the Trainer clips in the model's parameter order
        torch.nn.utils.clip_grad_norm_(setup.main_params(setup.model.parameters()), 1.0)
        setup.step()
        sched.step()
        setup.zero_grad()
    return losses, amped.memory_report(setup.model, setup.optimizer)


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe",
    ["fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "bf16-pure", "bf16-pure-sr"],
)
def test_each_recipe_in_the_trainer_is_the_hand_written_loop(recipe, tmp_path):
    reports = []

    class Recording(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            reports.append(trainer.accelerator.memory_report())

    model = tiny_llama()
    trainer = AmpedTrainer(
        model=model,
        args=arguments(tmp_path),
        train_dataset=dataset(),
        recipe=recipe,
        callbacks=[Recording()],
    )
    trainer.train()
    losses, report = hand_loop(recipe)
    assert reports[-1] == report
    # The Trainer drives the same TrainSetup in the same order: no tolerance needed.
    assert _equal(trainer.losses, losses)


@pytest.mark.parametrize("recipe", ["fp16-mixed", "fp16-master"])
def test_trainer_resume_is_bitwise_with_overflows(recipe, tmp_path):
    overflows = (1, 4)
    args = arguments(tmp_path, save_strategy="steps", save_steps=3)
    whole, whole_params = train(
        AmpedTrainer, tmp_path, args=args, recipe=recipe, overflow_at=overflows
    )
    # The scheduler skipped with the optimizer: 6 steps, 2 skipped.
    assert whole.lr_scheduler.last_epoch == STEPS - len(overflows)
    checkpoint = tmp_path / "checkpoint-3"
    assert (checkpoint / "scaler.pt").exists()
    assert (checkpoint / RECIPE_STATE_NAME).exists()
    AcceleratorState._reset_state(True)
    resumed, params = train(
        AmpedTrainer,
        tmp_path,
        args=args,
        recipe=recipe,
        overflow_at=overflows,
        resume=str(checkpoint),
    )
    assert _equal(whole.losses[3:], resumed.losses)
    assert _equal(whole_params, params)
    assert (
        resumed.accelerator.recipe_scaler.state_dict()
        == whole.accelerator.recipe_scaler.state_dict()
    )


def test_bad_arguments_fail_at_construction(tmp_path):
    with pytest.raises(ValueError, match="Unknown recipe"):
        Trainer(model=tiny_llama(), args=arguments(tmp_path), recipe="bf17")
    with pytest.raises(ValueError, match=r"leaves TrainingArguments\(bf16=False\)"):
        Trainer(model=tiny_llama(), args=arguments(tmp_path, bf16=True), recipe="bf16-mixed")
    with pytest.raises(ValueError, match="policy is for device 'cuda'"):
        Trainer(
            model=tiny_llama(),
            args=arguments(tmp_path),
            recipe="bf16-mixed",
            policy=amped.Policy.preset("torch", "cuda"),
        )


def _fp32_weights(setup) -> dict[str, torch.Tensor]:
    """The recipe's float32 weights by parameter name, read from the recipe's own
    state: O2's masters, bf16-pure's weights plus their Kahan compensation."""
    names = {id(p): name for name, p in setup.model.named_parameters()}
    if hasattr(setup.optimizer, "pairs"):  # O2; parameters it keeps in float32 have none
        out = {name: p.detach().clone() for name, p in setup.model.named_parameters()}
        out.update({names[id(p)]: m.detach().clone() for p, m in setup.optimizer.pairs})
        return out
    out = {}
    for name, p in setup.model.named_parameters():
        compensation = setup.optimizer.state[p].get("compensation")
        out[name] = p.detach().float() + (0 if compensation is None else compensation)
    return out


class RecordWeights(transformers.TrainerCallback):
    """The recipe's float32 weights at each checkpoint and at the last step."""

    def __init__(self) -> None:
        self.at_save: dict[int, dict[str, torch.Tensor]] = {}
        self.last: dict[str, torch.Tensor] = {}

    def on_step_end(self, args, state, control, **kwargs):
        self.last = _fp32_weights(self.trainer.accelerator.setup)

    def on_save(self, args, state, control, **kwargs):
        self.at_save[state.global_step] = _fp32_weights(self.trainer.accelerator.setup)


def _check_file(path, expected: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import load_file

    saved = load_file(str(path))
    assert {t.dtype for t in saved.values()} == {torch.float32}, path
    for name, weight in expected.items():
        if name in saved:  # a tied weight (lm_head) is saved once
            assert torch.equal(saved[name], weight), (path, name)
    assert set(saved) <= set(expected), path


@pytest.mark.parametrize(
    "recipe",
    ["bf16-master", pytest.param("bf16-pure", marks=pytest.mark.slow)],  # compiles its step
)
def test_trainer_ends_and_saves_in_float32_equal_to_the_masters(recipe, tmp_path):
    args = arguments(tmp_path, save_strategy="steps", save_steps=2)
    model = tiny_llama()
    recorder = RecordWeights()
    trainer = AmpedTrainer(model=model, args=args, train_dataset=dataset(), recipe=recipe,
                           callbacks=[recorder])  # fmt: skip
    recorder.trainer = trainer
    trainer.train()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    for name, param in model.named_parameters():  # teardown gave back the final masters
        assert torch.equal(param.detach(), recorder.last[name]), name
    trainer.save_model(str(tmp_path / "final"))
    _check_file(tmp_path / "final" / "model.safetensors", recorder.last)
    assert sorted(recorder.at_save) == [2, 4, 6]
    for step, weights in recorder.at_save.items():
        _check_file(tmp_path / f"checkpoint-{step}" / "model.safetensors", weights)
    reloaded = LlamaForCausalLM.from_pretrained(str(tmp_path / "final"))
    assert reloaded.dtype == torch.float32


def test_trainer_resume_of_a_lowered_model_is_bitwise(tmp_path):
    args = arguments(tmp_path, save_strategy="steps", save_steps=3)
    whole, whole_params = train(AmpedTrainer, tmp_path, args=args, recipe="bf16-pure")
    AcceleratorState._reset_state(True)
    resumed, params = train(AmpedTrainer, tmp_path, args=args, recipe="bf16-pure",
                            resume=str(tmp_path / "checkpoint-3"))  # fmt: skip
    assert _equal(whole.losses[3:], resumed.losses)
    assert _equal(whole_params, params)
    assert {p.dtype for p in params} == {torch.float32}


def test_trainer_recipe_state_file_runs_no_code(tmp_path):
    # A pickle planted as amped_recipe.pt is refused unexecuted, with the file named.
    import os

    from amped.checkpoint import CheckpointError

    args = arguments(tmp_path, save_strategy="steps", save_steps=3)
    train(AmpedTrainer, tmp_path, args=args, recipe="fp16-mixed")
    path, marker = tmp_path / "checkpoint-3" / RECIPE_STATE_NAME, tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    torch.save({"recipe": "fp16-mixed", "scaler": Payload()}, path)
    AcceleratorState._reset_state(True)
    with pytest.raises(CheckpointError, match=RECIPE_STATE_NAME) as raised:
        train(AmpedTrainer, tmp_path, args=args, recipe="fp16-mixed", resume=str(path.parent))
    assert str(path) in str(raised.value)
    assert not marker.exists()
