"""Tiny models for generation tests, built by parameter surgery on a random jaxmtp model.

- "random": O(1)-scale random weights everywhere; the MTP layer almost never agrees.
- "always": the main model's attention and FFN outputs are zeroed, so its prediction depends only
  on the current token: next = g(t), where the head is built so that g is one long cycle through
  the vocabulary (varied text, no early loops). The MTP layer is made to compute exactly that rule for the
  token it is given (eh_proj passes the embedding half through, its block adds nothing,
  shared_head.norm has the main final norm's weights), so every draft is what the main model would
  say: acceptance 100%.
- "never": as "always" with shared_head.norm negated: the MTP picks the main model's least likely
  token, acceptance 0%.
- "partial": "always" plus small random attention/FFN contributions in the main and MTP layers, so
  context matters and drafts are accepted often but not always; every cache path is exercised.
"""

import functools

import jax
import numpy as np

import jaxmtp

# A dense layer and two MoE layers (the shipped tiny config has three): every layer kind and a
# stack of more than one; the auto and one-trace tests ran in 0.89-0.94 of their time with four.
TINY = jaxmtp.ModelConfig.from_hf_config(f"{jaxmtp.CONFIGS}/tiny.json").replace(num_hidden_layers=3)
OUTPUT_PROJECTIONS = ("o_proj", "down_proj")
# For meshes of 8 devices: every sharded dimension divisible by 8 (8 heads, 8 experts, MLPs 128 / 32,
# vocab 512). A query LoRA of 32 makes the decode layout fold W_uk into q_b_proj
# (layout.absorbed_queries), whose columns the tensor axis then splits by head.
MESH_CONFIG = TINY.replace(num_attention_heads=8, q_lora_rank=32)
# Eight ragged prompts: a batch that a data axis of 2, 4 or 8 splits.
MESH_PROMPTS = [[3, 4, 5], [7], [11, 12, 13, 14, 15, 16], [100, 200], [9, 9, 9, 9], [1, 2], [300], [42, 43, 44]]
CONTEXT = 0.7  # scale of the attention/FFN contributions in the "partial" model: ~60% acceptance


def _randomize(params, rng):
    def one(path, leaf):
        name = jax.tree_util.keystr(path)
        if "embed_tokens" in name:  # unit-RMS rows, the scale of a layer's output
            return rng.normal(size=leaf.shape).astype(np.float32)
        if "e_score_correction_bias" in name:
            return 0.3 * rng.normal(size=leaf.shape).astype(np.float32)
        if leaf.ndim - ("['layers']" in name) - ("['experts']" in name) == 1:
            return (1.0 + 0.2 * rng.normal(size=leaf.shape)).astype(np.float32)
        return (rng.normal(size=leaf.shape) / np.sqrt(leaf.shape[-1])).astype(np.float32)
    return jax.tree_util.tree_map_with_path(one, params)


def _scale_outputs(tree, factor):
    """Multiplies every attention/FFN output projection (what a layer adds to the residual) by factor."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: leaf * factor if any(p in jax.tree_util.keystr(path) for p in OUTPUT_PROJECTIONS)
        else leaf, tree)


def _cycle_head(params, config, rng):
    """Head rows: row v is the final hidden state of token cycle^-1(v) (its normalised embedding
    times the final norm's weights), so that for a bare embedding the largest logit is cycle(t)."""
    embed = np.asarray(params["embed_tokens"]["weight"])
    hidden = embed / np.sqrt((embed ** 2).mean(axis=1, keepdims=True)) * np.asarray(params["norm"]["weight"])
    order = rng.permutation(config.vocab_size)
    successor = np.empty_like(order)
    successor[order] = np.roll(order, -1)  # one cycle through every token
    head = np.empty_like(hidden)
    head[successor] = hidden
    return (head / np.sqrt(config.hidden_size)).astype(np.float32)


@functools.cache
def model(kind: str, config: jaxmtp.ModelConfig = TINY, seed: int = 0, head_scale: float = 1.0) -> jaxmtp.Model:
    """head_scale < 1 flattens the output distributions (for sampling tests)."""
    rng = np.random.default_rng(seed)
    params = _randomize(jaxmtp.init(config, seed=seed).params, rng)
    if kind == "random":
        return jaxmtp.Model(config, params)
    context = {"always": 0.0, "never": 0.0, "partial": CONTEXT}[kind]
    params = {key: (_scale_outputs(value, context) if key in ("dense_layers", "moe_layers") else value)
              for key, value in params.items()}
    mtp = dict(params["mtp"])
    mtp["block"] = _scale_outputs(mtp["block"], context)
    d = config.hidden_size
    mtp["eh_proj"] = {"weight": np.concatenate([np.eye(d), context * rng.normal(size=(d, d)) / np.sqrt(d)],
                                               axis=1).astype(np.float32)}
    mtp["enorm"] = {"weight": np.ones(d, np.float32)}
    sign = -1.0 if kind == "never" else 1.0
    mtp["shared_head_norm"] = {"weight": sign * np.asarray(params["norm"]["weight"])}
    params["lm_head"] = {"weight": head_scale * _cycle_head(params, config, rng)}
    params["mtp"] = mtp
    return jaxmtp.Model(config, jax.tree.map(jax.numpy.asarray, params))


def byte_tokenizer(path, text: str = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)"):
    """A byte-level BPE tokenizer of 300 ids (within TINY's vocabulary) trained on `text`, saved to
    path (a tokenizer.json) and returned."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([text] * 4, trainer)
    tokenizer.save(str(path))
    return tokenizer

# DeepSeek-V4 on two processes (tests/multiprocess_v4_worker.py): four ragged prompts, a batch that
# the mesh's data axis of 2 splits, some past the test model's sliding window and compression blocks.
V4_MESH_PROMPTS = [[5, 17, 3, 9, 12, 60, 2, 8, 33, 1, 7, 19, 4, 25], [7], [11, 12, 13, 14, 15, 16], [100, 20, 3]]
V4_MESH_TOKENS = 10
