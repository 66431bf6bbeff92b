"""Training a DeepSeek-V3-architecture model with its MTP module, DeepSeek-V3's way, at small scale.

Loss = next-token cross-entropy + lambda x MTP cross-entropy (lambda = 0.3): MTP slot p sees the
main model's post-norm hidden state h_p and t_{p+1} and predicts t_{p+2}; its loss trains the main
model too. Expert load is balanced without an auxiliary loss: after each step every MoE layer's
selection bias moves by `bias_rate` towards under-loaded experts (b_i += rate x sign(mean load -
load_i)); the bias only decides which experts are chosen, so it gets no gradient.

`mtp_only` fine-tunes just the MTP module on a frozen main model's hidden states, distilling the
main model's own next-token distribution into it (what speculative acceptance rewards). With
`mtp_depth` > 1 it is trained for drafting several tokens the way generation chains it: draft j
reads the MTP layer's own output hidden state of draft j - 1 instead of the main model's.
"""

from __future__ import annotations

import dataclasses
import json
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from jaxmtp.data import windows
from jaxmtp.errors import InputError
from jaxmtp.model import Model
from jaxmtp.params import module, positions_for
from jaxmtp.transformer import DeepseekV3

BIAS = "e_score_correction_bias"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 3000
    batch: int = 16
    seq_len: int = 256
    learning_rate: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.1
    mtp_lambda: float = 0.3
    bias_rate: float = 1e-3
    seed: int = 0
    mtp_only: bool = False
    mtp_depth: int = 1  # mtp_only: chained drafting steps trained (see `chained_distillation`)

    def __post_init__(self):
        if not 1 <= self.mtp_depth < self.seq_len or (self.mtp_depth > 1 and not self.mtp_only):
            raise InputError(f"mtp_depth: expected 1 <= mtp_depth < seq_len ({self.seq_len}), and > 1 only with "
                             f"mtp_only; found {self.mtp_depth}")


def cross_entropy(logits, targets):
    """Mean next-token loss. logits [B, T, V] f32, targets [B, T]."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def forward_losses(params, tokens, config):
    """tokens [B, T+2] -> (main loss, MTP loss, main logits, MTP logits, expert loads).

    Main: positions 0..T-1 predict tokens 1..T. MTP: slot p uses h_p and token p+1, predicts p+2.
    """
    x, next_tokens, after_next = tokens[:, :-2], tokens[:, 1:-1], tokens[:, 2:]
    positions = positions_for(x)
    logits, hidden, main_loads = _main_pass(params, x, positions, config)
    mtp_logits, _, mtp_loads = _mtp_pass(params, hidden, next_tokens, positions, config)
    loads = {**main_loads, **mtp_loads}
    return cross_entropy(logits, next_tokens), cross_entropy(mtp_logits, after_next), logits, mtp_logits, loads


def _main_pass(params, x, positions, config):
    """x, positions [B, T] -> (logits [B, T, V], post-norm hidden [B, T, D], expert loads)."""
    (logits, hidden, _), state = module(config).apply({"params": params}, x, positions, mutable=["intermediates"])
    return logits, hidden, state.get("intermediates", {})


def _mtp_pass(params, hidden, next_tokens, positions, config):
    """hidden [B, T, D], next_tokens/positions [B, T] -> (MTP logits, MTP hidden, expert loads)."""
    (logits, z, _), state = module(config).apply({"params": params}, hidden, next_tokens, positions,
                                                 method=DeepseekV3.mtp_step, mutable=["intermediates"])
    return logits, z, state.get("intermediates", {})


def distillation(logits, mtp_logits):
    """Cross-entropy from the frozen main model's distribution for token p+2 (its logits at p+1) to
    the MTP module's at slot p: a draft is accepted when it agrees with the main model, so that is
    the target, not the text. logits, mtp_logits [B, T, V] -> scalar."""
    target = jax.nn.softmax(jax.lax.stop_gradient(logits[:, 1:]), axis=-1)
    return -(target * jax.nn.log_softmax(mtp_logits[:, :-1], axis=-1)).sum(-1).mean()


def chained_distillation(params, tokens, config, depth: int):
    """The MTP-only objective over `depth` chained drafting steps; tokens [B, T+2].

    Step 1 is `forward_losses`' MTP pass: slot s reads (h_s, t_{s+1}). Step j > 1 reads, at slot s,
    the MTP output hidden state of step j - 1 at slot s - 1 and t_{s+1}, as the j-th draft of a
    round reads the (j-1)-th draft's (tokens teacher-forced; attention sees step j's own slots).
    Each step is distilled towards the frozen main model's distribution for the token it drafts.
    Returns (main loss, losses [depth], expert loads of step 1).
    """
    x = tokens[:, :-2]
    positions = positions_for(x)
    logits, hidden, loads = jax.lax.stop_gradient(_main_pass(params, x, positions, config))
    losses = []
    for j in range(1, depth + 1):  # step j covers slots j-1 .. T-1
        mtp_logits, z, mtp_loads = _mtp_pass(params, hidden, tokens[:, j:-1], positions[:, j - 1:], config)
        losses.append(distillation(logits[:, j - 1:], mtp_logits))
        if j == 1:
            loads = {**loads, **mtp_loads}
        hidden = z[:, :-1]  # slot s feeds slot s + 1 of the next step
    return cross_entropy(logits, tokens[:, 1:-1]), jnp.stack(losses), loads


def _labels(params, mtp_only):
    """'train' or 'frozen' per leaf: selection biases are never trained by gradient."""
    def label(path, _):
        keys = [getattr(p, "key", None) for p in path]
        frozen = BIAS in keys or (mtp_only and keys[0] != "mtp")
        return "frozen" if frozen else "train"
    return jax.tree_util.tree_map_with_path(label, params)


def optimizer(params, cfg: TrainConfig):
    """AdamW with warmup and cosine decay, clipped at global norm 1, no weight decay on vectors;
    parameters outside the trained set (all but `mtp` with mtp_only) are frozen."""
    warmup = min(cfg.warmup, cfg.steps // 10)
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, warmup, max(cfg.steps, warmup + 1),
                                                  cfg.learning_rate / 10)
    decay = jax.tree.map(lambda x: x.ndim >= 2, params)  # no weight decay on norms
    adamw = optax.chain(optax.clip_by_global_norm(1.0),
                        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay, mask=decay))
    return optax.multi_transform({"train": adamw, "frozen": optax.set_to_zero()}, _labels(params, cfg.mtp_only))


def update_biases(params, loads, rate, mtp_only):
    """b_i += rate x sign(mean load - load_i) for every MoE layer (the aux-loss-free rule)."""
    def nudge(bias, load):
        load = load.astype(jnp.float32)
        return bias + rate * jnp.sign(load.mean(axis=-1, keepdims=True) - load)

    params = dict(params)
    if "moe_layers" in params and not mtp_only:
        load = loads["moe_layers"]["layers"]["mlp"]["expert_load"][0]  # [L, E]
        params["moe_layers"] = _replace_bias(params["moe_layers"], ("layers", "mlp", "gate"), nudge, load)
    if "mtp" in params:
        load = loads["mtp"]["block"]["mlp"]["expert_load"][0]  # [E]
        params["mtp"] = _replace_bias(params["mtp"], ("block", "mlp", "gate"), nudge, load)
    return params


def _replace_bias(tree, path, fn, load):
    if not path:
        return {**tree, BIAS: fn(tree[BIAS], load)}
    return {**tree, path[0]: _replace_bias(tree[path[0]], path[1:], fn, load)}


@partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(3, 4))
def train_step(config, cfg: TrainConfig, tx, params, opt_state, tokens):
    """One optimizer step on tokens [B, T + 2] -> (params, opt_state, main loss, MTP loss); the
    routing biases then move by the aux-loss-free rule (`update_biases`)."""
    def loss_fn(p):
        if cfg.mtp_only:
            main, steps, loads = chained_distillation(p, tokens, config, cfg.mtp_depth)
            return steps.mean(), (main, steps.mean(), loads)
        main, mtp, _, _, loads = forward_losses(p, tokens, config)
        return main + cfg.mtp_lambda * mtp, (main, mtp, loads)

    (_, (main, mtp, loads)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    params = update_biases(params, loads, cfg.bias_rate, cfg.mtp_only)
    return params, opt_state, main, mtp


def train(model: Model, tokens: np.ndarray, cfg: TrainConfig, log_path: str | None = None,
          quiet: bool = False) -> tuple[Model, list[dict]]:
    """Trains `model` on random windows of `tokens`. Returns the trained model and the loss log
    (one entry per 10 steps), also written as JSON lines to log_path."""
    rng = np.random.default_rng(cfg.seed)
    tx = optimizer(model.params, cfg)
    params = jax.tree.map(jnp.array, model.params)  # a private copy: the step donates its buffers
    opt_state = tx.init(params)
    log = []
    log_file = open(log_path, "w") if log_path else None
    bar = tqdm(range(cfg.steps), desc="mtp-only" if cfg.mtp_only else "training", disable=quiet)
    for step in bar:
        batch = windows(tokens, rng, cfg.batch, cfg.seq_len + 2)
        params, opt_state, main, mtp = train_step(model.config, cfg, tx, params, opt_state, batch)
        if step % 10 == 0 or step == cfg.steps - 1:
            entry = {"step": step, "main_loss": float(main), "mtp_loss": float(mtp)}
            log.append(entry)
            bar.set_postfix(main=f"{entry['main_loss']:.3f}", mtp=f"{entry['mtp_loss']:.3f}")
            if log_file:
                log_file.write(json.dumps(entry) + "\n")
                log_file.flush()
    if log_file:
        log_file.close()
    return Model(model.config, params), log


@partial(jax.jit, static_argnums=0)
def _eval_batch(config, params, tokens):
    main, mtp, logits, mtp_logits, _ = forward_losses(params, tokens, config)
    x_next, after_next = tokens[:, 1:-1], tokens[:, 2:]
    main_top1 = (logits.argmax(-1) == x_next).mean()
    # The MTP module's draft agrees with what the main model would say two tokens ahead:
    # what greedy speculative decoding accepts when the main model's own prediction is the input.
    mtp_top1 = (mtp_logits.argmax(-1) == after_next).mean()
    return main, mtp, main_top1, mtp_top1


def evaluate(model: Model, tokens: np.ndarray, seq_len: int = 256, batch: int = 16) -> dict:
    """Teacher-forced held-out figures over consecutive windows: main loss / perplexity / top-1,
    MTP loss and top-1 (predicting t_{p+2}), and a unigram baseline fitted on the same tokens."""
    length = seq_len + 2
    n = (len(tokens) - 1) // length
    rows = np.stack([tokens[i * length:(i + 1) * length] for i in range(n)])
    sums = np.zeros(4)
    for start in range(0, n - batch + 1, batch):
        sums += np.asarray(_eval_batch(model.config, model.params, rows[start:start + batch]), np.float64)
    main, mtp, main_top1, mtp_top1 = sums / (n // batch)
    counts = np.bincount(tokens, minlength=model.config.vocab_size) + 1e-9
    unigram = -(np.log(counts / counts.sum())[tokens]).mean()
    return {"tokens": int((n // batch) * batch * seq_len), "main_loss": main, "main_perplexity": float(np.exp(main)),
            "main_top1": main_top1, "mtp_loss": mtp, "mtp_top1": mtp_top1, "unigram_loss": float(unigram),
            "unigram_perplexity": float(np.exp(unigram))}


def record(cfg: TrainConfig, data_summary: dict, log: list[dict], held_out: dict, held_out_before: dict | None = None,
           init: str | None = None, command: str | None = None) -> dict:
    """What a checkpoint's training.json holds: the command and settings, the data it read
    (`data.Corpus.summary`), the last losses, and the held-out figures (`evaluate`) after training and,
    for a fine-tuned checkpoint, before."""
    figures = {"command": command, "train_config": dataclasses.asdict(cfg), "data": data_summary,
               "final_losses": log[-1], "held_out": held_out, "held_out_before": held_out_before}
    return figures if init is None else dict(figures, init=init)


def describe(figures: dict) -> str:
    """`evaluate`'s figures in one line."""
    f = figures
    return (f"main loss {f['main_loss']:.3f} (perplexity {f['main_perplexity']:.1f}, top-1 {f['main_top1']:.3f}), "
            f"MTP loss {f['mtp_loss']:.3f} (top-1 {f['mtp_top1']:.3f}); unigram baseline loss "
            f"{f['unigram_loss']:.3f} (perplexity {f['unigram_perplexity']:.1f})")
