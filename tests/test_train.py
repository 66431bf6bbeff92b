"""Training: the MTP loss pairing, the aux-loss-free bias rule, MTP-only fine-tuning, the corpus split."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmtp
from jaxmtp import data
from jaxmtp.params import module, positions_for
from jaxmtp.train import TrainConfig, chained_distillation, distillation, forward_losses, train, update_biases
from jaxmtp.transformer import DeepseekV3

TINY = jaxmtp.ModelConfig.from_hf_config(f"{jaxmtp.CONFIGS}/tiny.json")


def _periodic_tokens(period=7, length=4000, seed=0):
    """A stream that repeats a random phrase: every token is predictable one and two steps ahead."""
    phrase = np.random.default_rng(seed).integers(2, TINY.vocab_size, period)
    return np.tile(phrase, length // period).astype(np.int32)


def test_mtp_loss_predicts_two_ahead_from_hidden_and_next_token():
    """The MTP cross-entropy equals the one computed by hand from Model.forward / mtp_forward with
    slot p given (h_p, t_{p+1}) and scored on t_{p+2}."""
    model = jaxmtp.init(TINY, seed=1)
    tokens = np.random.default_rng(0).integers(0, TINY.vocab_size, (2, 18)).astype(np.int32)
    main, mtp, _, _, _ = forward_losses(model.params, tokens, TINY)
    logits, hidden = model.forward(tokens[:, :-2])
    mtp_logits = np.asarray(model.mtp_forward(hidden, tokens[:, 1:-1]), np.float64)

    def ce(lg, targets):
        lg = lg - lg.max(-1, keepdims=True)
        logp = lg - np.log(np.exp(lg).sum(-1, keepdims=True))
        return -np.take_along_axis(logp, targets[..., None], -1).mean()

    np.testing.assert_allclose(float(main), ce(np.asarray(logits, np.float64), tokens[:, 1:-1]), rtol=1e-5)
    np.testing.assert_allclose(float(mtp), ce(mtp_logits, tokens[:, 2:]), rtol=1e-5)


def test_bias_update_moves_towards_underloaded_experts():
    model = jaxmtp.init(TINY, seed=0)
    moe_load = np.array([[5, 0, 3, 0, 0, 8, 0, 0]] * TINY.num_moe_layers)  # [L, E], mean 2
    mtp_load = np.array([2, 2, 2, 2, 0, 0, 4, 4])  # mean 2
    loads = {"moe_layers": {"layers": {"mlp": {"expert_load": (moe_load,)}}},
             "mtp": {"block": {"mlp": {"expert_load": (mtp_load,)}}}}
    new = update_biases(model.params, loads, 0.01, mtp_only=False)
    moe_bias = np.asarray(new["moe_layers"]["layers"]["mlp"]["gate"]["e_score_correction_bias"])
    np.testing.assert_allclose(moe_bias, 0.01 * np.sign(2 - moe_load), atol=1e-7)
    mtp_bias = np.asarray(new["mtp"]["block"]["mlp"]["gate"]["e_score_correction_bias"])
    np.testing.assert_allclose(mtp_bias, [0, 0, 0, 0, 0.01, 0.01, -0.01, -0.01], atol=1e-7)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("train") / "log.jsonl")
    cfg = TrainConfig(steps=60, batch=4, seq_len=32, learning_rate=1e-2, warmup=5, bias_rate=1e-2)
    model, log = train(jaxmtp.init(TINY, seed=0), _periodic_tokens(), cfg, log_path, quiet=True)
    return model, log, log_path


def test_training_learns_a_periodic_stream_and_balances_experts(trained):
    model, log, log_path = trained
    first, last = log[0], log[-1]
    assert first["main_loss"] > 5.5 and first["mtp_loss"] > 5.5  # ~ log(512) at random init
    assert last["main_loss"] < 1.0 and last["mtp_loss"] < 1.0, last
    assert len(open(log_path).readlines()) == len(log)
    bias = np.asarray(model.params["moe_layers"]["layers"]["mlp"]["gate"]["e_score_correction_bias"])
    assert np.abs(bias).max() > 0  # the aux-loss-free rule ran


def _numpy_distillation(main_logits, mtp_logits):
    """Cross-entropy from softmax(main_logits) to softmax(mtp_logits), mean over rows; float64."""
    p = np.exp(main_logits - main_logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    log_q = mtp_logits - mtp_logits.max(-1, keepdims=True)
    log_q -= np.log(np.exp(log_q).sum(-1, keepdims=True))
    return -(p * log_q).sum(-1).mean()


def test_distillation_is_cross_entropy_to_the_main_models_next_prediction():
    rng = np.random.default_rng(3)
    logits, mtp_logits = rng.normal(size=(2, 2, 6, 11)).astype(np.float32)
    want = _numpy_distillation(logits[:, 1:].astype(np.float64), mtp_logits[:, :-1].astype(np.float64))
    np.testing.assert_allclose(float(distillation(logits, mtp_logits)), want, rtol=1e-5)


def test_chained_steps_draft_from_the_previous_steps_hidden_state():
    """Step j of the MTP-only objective, rebuilt slot by slot: slot s of step j reads step j-1's MTP
    output at slot s-1 (the main model's h_s for j = 1) and t_{s+1}, and is scored against the main
    model's distribution at position s+1. Each step is re-run from position 0: RoPE attention scores
    depend only on position differences, so the shift must not change the result."""
    model = jaxmtp.init(TINY, seed=1)
    tokens = np.random.default_rng(2).integers(0, TINY.vocab_size, (2, 14)).astype(np.int32)
    t = tokens.shape[1] - 2
    main, steps, _ = jax.jit(chained_distillation, static_argnums=(2, 3))(model.params, tokens, TINY, 3)
    logits, hidden = (np.asarray(a, np.float64) for a in model.forward(tokens[:, :-2]))
    mtp = jax.jit(lambda h, nxt: module(TINY).apply({"params": model.params}, jnp.asarray(h, jnp.float32), nxt,
                                                    positions_for(nxt), method=DeepseekV3.mtp_step))
    reads = {s: hidden[:, s] for s in range(t)}  # slot -> the hidden state it reads in this step
    for j in range(1, 4):
        slots = range(j - 1, t)
        mtp_logits, z, _ = mtp(np.stack([reads[s] for s in slots], axis=1), tokens[:, [s + 1 for s in slots]])
        want = _numpy_distillation(logits[:, [s + 1 for s in slots[:-1]]], np.asarray(mtp_logits, np.float64)[:, :-1])
        np.testing.assert_allclose(float(steps[j - 1]), want, rtol=2e-5)
        reads = {s + 1: np.asarray(z)[:, i] for i, s in enumerate(slots)}
    np.testing.assert_allclose(float(main), float(forward_losses(model.params, tokens, TINY)[0]), rtol=1e-6)


def test_mtp_only_changes_only_the_mtp_module(trained):
    model = trained[0]
    tokens = _periodic_tokens(seed=1)
    tuned, log = train(model, tokens, TrainConfig(steps=20, batch=4, seq_len=32, learning_rate=1e-2, warmup=2,
                                                  mtp_only=True, mtp_depth=2), quiet=True)
    for key in model.params:
        same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), model.params[key], tuned.params[key])
        assert all(jax.tree.leaves(same)) == (key != "mtp"), key
    assert log[-1]["mtp_loss"] < log[0]["mtp_loss"]


def test_chained_depth_needs_mtp_only_and_fits_the_window():
    for bad in (dict(mtp_depth=2), dict(mtp_only=True, mtp_depth=0), dict(mtp_only=True, mtp_depth=32, seq_len=32)):
        with pytest.raises(ValueError, match="mtp_depth"):
            TrainConfig(**bad)


def test_corpus_excludes_tests_and_holds_out_fixed_modules():
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    train_files, held_out = data.source_files()
    assert len(train_files) > 500 and held_out and not set(train_files) & set(held_out)
    top = lambda path: os.path.relpath(path, root).split(os.sep)[0].removesuffix(".py")  # noqa: E731
    assert {top(p) for p in held_out} == set(data.HELD_OUT_MODULES)
    assert not {top(p) for p in train_files} & set(data.HELD_OUT_MODULES)
    for path in train_files + held_out:
        parts = os.path.relpath(path, root).split(os.sep)
        assert not {"test", "tests", "idle_test", "site-packages"} & set(parts) and not parts[-1].startswith("test_")
