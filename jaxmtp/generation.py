"""`generate`: prefill and every decode round inside one jitted `lax.while_loop`.

Plain decoding is the k = 0 case of the speculative round: feed t_n, choose the next token. With
k > 0 each round drafts d1..dk with the MTP layer, verifies [t_n, d1..dk] in one main forward,
commits the accepted drafts plus one token, and repairs the MTP cache with the main model's hidden
states (spec section 10). Rows advance independently: every row has its own position n (the
position of its newest token t_n, not yet fed to the model), and the caches are addressed by
absolute position, so a rejected draft is rolled back by simply not advancing past it.

Shapes are padded to buckets (batch, prompt length, cache length) so that new prompt lengths reuse a
compiled function; everything else (lengths, limits, EOS, sampling values, seed) is traced.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence
from functools import partial

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp import calibration, checks
from jaxmtp.adaptive import AcceptanceCounts, best_k
from jaxmtp.cache import MLACache
from jaxmtp.config import ModelConfig
from jaxmtp.layout import Layout
from jaxmtp.model import Model, module
from jaxmtp.sampling import SamplingMode, SamplingParams, choose
from jaxmtp.speculative import verify_greedy, verify_sampled
from jaxmtp.transformer import DeepseekV3

MAX_SPECULATIVE_K = 8
AUTO_MAX_K = 4  # speculative_k="auto" chooses among k = 0..AUTO_MAX_K
AUTO_SEGMENT = 8  # ... once every this many rounds
# How often each jitted generation function was traced, by its static signature: a trace counter
# that tests use to check one compile per shape bucket, k and sampling mode.
TRACES: collections.Counter = collections.Counter()


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything the compiled loop is specialised on. k: the drafts per round, or with `auto` the
    most that a round may draft (each round then chooses its own k in 0..k)."""

    config: ModelConfig
    dtype: jnp.dtype
    k: int
    mode: SamplingMode
    cache_len: int
    layout: Layout
    auto: bool = False


@flax.struct.dataclass
class DecodeState:
    """The while-loop carry. B rows, S = cache length, W = S + k + 1 token slots.

    seq [B, W]: tokens by position (prompt, then generated); n [B]: position of t_n; count [B]: new
    tokens so far; done [B]. draft/draft_hidden/draft_probs: d1 for the next round, the MTP hidden
    state at its slot [B, D] and its distribution [B, V] (sampling only). Stats per row: rounds,
    drafted, accepted, accepted_at [B, k] (rounds in which draft i was accepted), rounds_at
    [B, k + 1] (rounds run at each k); steps: main forward passes of the batch. counts: the
    batch's acceptance by draft position, which `speculative_k="auto"` chooses k from.
    """

    seq: jax.Array
    n: jax.Array
    count: jax.Array
    done: jax.Array
    caches: dict
    mtp_cache: MLACache | None
    draft: jax.Array
    draft_hidden: jax.Array | None
    draft_probs: jax.Array | None
    key: jax.Array
    rounds: jax.Array
    drafted: jax.Array
    accepted: jax.Array
    accepted_at: jax.Array
    rounds_at: jax.Array
    counts: AcceptanceCounts
    steps: jax.Array


@dataclasses.dataclass
class GenerationOutput:
    """tokens: the new tokens of each prompt (up to and including EOS). stats: see `_stats`."""

    tokens: list[list[int]]
    stats: dict


def _apply(static: Static, params, *args, absorbed: bool = True, method):
    return module(static.config, static.dtype, absorbed, static.layout).apply({"params": params}, *args, method=method)


def _main(static, params, tokens, positions, caches, absorbed):
    """-> (logits [B, T, V] f32, post-norm hidden [B, T, D], caches)."""
    return _apply(static, params, tokens, positions, caches, absorbed=absorbed, method=DeepseekV3.__call__)


def _main_hidden(static, params, tokens, positions, caches, absorbed):
    """The main model without its head -> (post-norm hidden [B, T, D], caches)."""
    return _apply(static, params, tokens, positions, caches, absorbed=absorbed, method=DeepseekV3.hidden_states)


def _head(static, params, hidden):
    """hidden [B, D] -> logits [B, V] f32, for the one row per batch row that a choice needs."""
    return _apply(static, params, hidden[:, None], method=DeepseekV3.logits)[:, 0]


def _mtp(static, params, hidden, next_tokens, positions, cache, absorbed):
    """-> (logits [B, T, V] f32, MTP hidden [B, T, D], cache)."""
    return _apply(static, params, hidden, next_tokens, positions, cache, absorbed=absorbed,
                  method=DeepseekV3.mtp_step)


def _mtp_hidden(static, params, hidden, next_tokens, positions, cache, absorbed):
    """The MTP module without the head -> (MTP hidden [B, T, D], cache)."""
    return _apply(static, params, hidden, next_tokens, positions, cache, absorbed=absorbed,
                  method=DeepseekV3.mtp_hidden)


def _empty_caches(static: Static, batch: int):
    """The main stacks' caches: stacked [L, B, S, .] per group, or per-layer tuples when unrolled."""
    c = static.config
    groups = {"dense": c.num_dense_layers, "moe": c.num_moe_layers}
    if static.layout.unrolled:
        return {g: tuple(_rows_over_data(MLACache.zeros(c, None, batch, static.cache_len, static.dtype), batch_axis=0)
                         for _ in range(n)) for g, n in groups.items() if n}
    return {g: _rows_over_data(MLACache.zeros(c, n, batch, static.cache_len, static.dtype), batch_axis=1)
            for g, n in groups.items() if n}


def _rows_over_data(cache: MLACache, batch_axis: int) -> MLACache:
    """On a mesh (`jax.set_mesh`) whose data axis divides the batch, split the cache's rows over it."""
    mesh = jax.sharding.get_abstract_mesh()
    data = 0 if mesh.empty else mesh.shape.get("data", 1)
    if data <= 1 or cache.c_kv.shape[batch_axis] % data:
        return cache
    spec = jax.sharding.PartitionSpec(*([None] * batch_axis), "data")
    return jax.lax.with_sharding_constraint(cache, spec)


def _row_gather(x, index):
    """x [B, T, ...], index [B] -> x[b, index[b]] [B, ...]."""
    return jnp.take_along_axis(x, index.reshape((-1, 1) + (1,) * (x.ndim - 2)), axis=1)[:, 0]


def _finish(new_tokens, produced, count, limits, eos):
    """How many of a row's `produced` new tokens [B, T] to keep, and whether the row is now done:
    cut at max_new_tokens and just after the first of the EOS ids eos [E]."""
    slot = jnp.arange(new_tokens.shape[1])
    is_eos = (new_tokens[..., None] == eos).any(-1) & (slot < produced[:, None])
    first_eos = jnp.where(is_eos.any(axis=1), jnp.argmax(is_eos, axis=1) + 1, produced)
    kept = jnp.minimum(jnp.minimum(produced, first_eos), limits - count)
    return kept, is_eos.any(axis=1) | (count + kept >= limits)


def prefill(static: Static, params, prompt, lengths, limits, eos, sampling: SamplingParams, key, real):
    """Main forward over the prompts, the first token, and (k > 0) the MTP first pass -> d1.

    prompt [B, P] (right-padded), lengths [B], limits [B] (max new tokens), real [B] (False for
    batch padding rows).
    """
    batch, width = prompt.shape
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), prompt.shape)
    hidden, caches = _main_hidden(static, params, prompt, positions, _empty_caches(static, batch), absorbed=False)
    last = lengths - 1
    key, token_key, draft_key = jax.random.split(key, 3)
    first, _ = choose(token_key, _head(static, params, _row_gather(hidden, last)), static.mode, sampling)
    seq = jnp.zeros((batch, static.cache_len + static.k + 1), jnp.int32).at[:, :width].set(prompt)
    seq = seq.at[jnp.arange(batch), lengths].set(first)
    kept, done = _finish(first[:, None], jnp.ones_like(lengths), jnp.zeros_like(lengths), limits, eos)
    state = DecodeState(seq=seq, n=lengths, count=kept * real, done=done | ~real, caches=caches, mtp_cache=None,
                        draft=jnp.zeros_like(lengths), draft_hidden=None, draft_probs=None, key=key,
                        rounds=jnp.zeros_like(lengths), drafted=jnp.zeros_like(lengths),
                        accepted=jnp.zeros_like(lengths), accepted_at=jnp.zeros((batch, static.k), jnp.int32),
                        rounds_at=jnp.zeros((batch, static.k + 1), jnp.int32),
                        counts=AcceptanceCounts.zeros(static.k), steps=jnp.ones((), jnp.int32))
    if static.k == 0:
        return state
    # MTP slot p pairs h_p with t_{p+1}; the slot of the last prompt token pairs it with `first`.
    mtp_cache = _rows_over_data(MLACache.zeros(static.config, None, batch, static.cache_len, static.dtype), 0)
    z, mtp_cache = _mtp_hidden(static, params, hidden, seq[:, 1:width + 1], positions, mtp_cache, absorbed=False)
    z = _row_gather(z, last)
    draft, draft_probs = choose(draft_key, _head(static, params, z), static.mode, sampling)
    return state.replace(mtp_cache=mtp_cache, draft=draft, draft_hidden=z, draft_probs=draft_probs)


def _draft_rest(static, k, params, state: DecodeState, sampling, key):
    """d2..dk: the MTP layer re-run on its own output hidden state, one position further each time.
    Unrolled (k <= 8): on CPU a `lax.scan` here costs more than the MTP steps themselves.

    Returns (drafts [B, k], their distributions [B, k, V] or None, MTP cache)."""
    token, hidden, cache = state.draft, state.draft_hidden, state.mtp_cache
    tokens, probs = [token], [state.draft_probs]
    for j, step_key in enumerate(jax.random.split(key, k - 1)):
        position = state.n + j  # d_{j+2} comes from MTP slot n + j
        logits, z, cache = _mtp(static, params, hidden[:, None], token[:, None], position[:, None], cache,
                                absorbed=True)
        token, p = choose(step_key, logits[:, 0], static.mode, sampling)
        hidden = z[:, 0]
        tokens.append(token)
        probs.append(p)
    drafts = jnp.stack(tokens, axis=1)
    return drafts, (None if static.mode.greedy else jnp.stack(probs, axis=1)), cache


def decode_round(static: Static, k: int, params, state: DecodeState, limits, eos,
                 sampling: SamplingParams) -> DecodeState:
    """One round for every row at k <= static.k: draft (k > 0), verify in one main forward, accept,
    commit, repair. A round at k = 0 leaves the MTP state as it is."""
    batch = state.n.shape[0]
    key, draft_key, verify_key, next_key = jax.random.split(state.key, 4)
    t_n = _row_gather(state.seq, state.n)
    if k:
        drafts, draft_probs, mtp_cache = _draft_rest(static, k, params, state, sampling, draft_key)
    else:
        vocab = static.config.vocab_size
        drafts, draft_probs, mtp_cache = jnp.zeros((batch, 0), jnp.int32), jnp.zeros((batch, 0, vocab)), state.mtp_cache
    tokens = jnp.concatenate([t_n[:, None], drafts], axis=1)  # [B, k+1]
    positions = state.n[:, None] + jnp.arange(k + 1, dtype=jnp.int32)
    logits, hidden, caches = _main(static, params, tokens, positions, state.caches, absorbed=True)
    if static.mode.greedy:
        accepted, after = verify_greedy(drafts, logits)
    else:
        accepted, after = verify_sampled(verify_key, drafts, draft_probs, logits, static.mode, sampling)
    slot = jnp.arange(k + 1)
    new_tokens = jnp.where(slot < accepted[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), after[:, None])
    active = ~state.done
    kept, finished = _finish(new_tokens, accepted + 1, state.count, limits, eos)
    kept = kept * active
    write_at = jnp.where(slot < kept[:, None], positions + 1, state.seq.shape[1])
    state = state.replace(
        seq=state.seq.at[jnp.arange(batch)[:, None], write_at].set(new_tokens, mode="drop"),
        n=state.n + kept, count=state.count + kept, done=state.done | finished, caches=caches, key=key,
        rounds=state.rounds + active, drafted=state.drafted + k * active,
        accepted=state.accepted + accepted * active,
        accepted_at=state.accepted_at + (jnp.arange(static.k) < accepted[:, None]) * active[:, None],
        rounds_at=state.rounds_at.at[:, k].add(active), counts=state.counts.update(k, accepted, active),
        steps=state.steps + 1)
    if k == 0:
        return state
    # Repair: MTP slots n..n+k from the verified hidden states; slot n+a yields the next d1 (the
    # head runs for that slot only).
    z, mtp_cache = _mtp_hidden(static, params, hidden, new_tokens, positions, mtp_cache, absorbed=True)
    z = _row_gather(z, accepted)
    draft, probs = choose(next_key, _head(static, params, z), static.mode, sampling)
    return state.replace(mtp_cache=mtp_cache, draft=draft, draft_hidden=z, draft_probs=probs)


def _rounds(static: Static, params, state: DecodeState, limits, eos, sampling, costs, force_k) -> DecodeState:
    """The next round at static.k; or with `auto` the next AUTO_SEGMENT rounds (fewer once every
    row is done) at the k that `adaptive.best_k` (or force_k >= 0) says, one branch per k of a
    lax.switch: choosing once per segment spreads the switch's cost (it passes the whole loop
    state through) over several rounds."""
    if not static.auto:
        return decode_round(static, static.k, params, state, limits, eos, sampling)

    def segment(k, state):
        step = lambda carry: (carry[0] + 1, decode_round(static, k, params, carry[1], limits, eos, sampling))  # noqa: E731
        running = lambda carry: (carry[0] < AUTO_SEGMENT) & ~jnp.all(carry[1].done)  # noqa: E731
        return jax.lax.while_loop(running, step, (jnp.int32(0), state))[1]

    k = jnp.where(force_k >= 0, force_k, best_k(state.counts, costs))
    return jax.lax.switch(k, [partial(segment, j) for j in range(static.k + 1)], state)


@partial(jax.jit, static_argnums=0)
def _generate(static: Static, params, prompt, lengths, limits, eos, sampling, key, real, costs, force_k):
    """costs [k + 1]: round costs in plain steps, force_k: -1 or the k every round takes (auto only)."""
    TRACES[(static, prompt.shape)] += 1
    state = prefill(static, params, prompt, lengths, limits, eos, sampling, key, real)
    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done),
                               lambda s: _rounds(static, params, s, limits, eos, sampling, costs, force_k), state)
    return (state.seq, state.count, state.rounds, state.drafted, state.accepted, state.accepted_at, state.rounds_at,
            state.steps)


def bucket(n: int, smallest: int) -> int:
    """The padded size for n: a power of two >= smallest, then multiples of 1024 past 1024."""
    if n > 1024:
        return -(-n // 1024) * 1024
    return max(smallest, 1 << (n - 1).bit_length())


def _check_arguments(model: Model, prompts, max_new_tokens, temperature, top_k, top_p, speculative_k,
                     eos_token_id, seed) -> tuple[list[list[int]], tuple[int, ...]]:
    """Refuses bad arguments with a message naming them; returns the prompts as lists of ints and
    the EOS ids as a tuple."""
    c = model.config
    prompts = checks.prompts(prompts, c.vocab_size)
    for i, p in enumerate(prompts):
        if len(p) >= c.max_position_embeddings:
            raise ValueError(f"prompts[{i}]: {len(p)} tokens leave no room for a new one within "
                             f"max_position_embeddings = {c.max_position_embeddings}")
    checks.whole("max_new_tokens", max_new_tokens, minimum=1)
    checks.real("temperature", temperature, minimum=0)
    checks.whole("top_k", top_k, minimum=0)
    checks.real("top_p", top_p, minimum=0, maximum=1, above_minimum=True)
    checks.whole("seed", seed)
    if speculative_k != "auto":
        if isinstance(speculative_k, str):
            raise ValueError(f'speculative_k: expected "auto" or an integer 0..{MAX_SPECULATIVE_K}, '
                             f"found {speculative_k!r}")
        checks.whole("speculative_k", speculative_k, minimum=0, maximum=MAX_SPECULATIVE_K)
    if speculative_k not in (0, "auto") and not c.has_mtp:
        raise ValueError("speculative_k > 0 needs an MTP module; this model has num_nextn_predict_layers = 0")
    return prompts, checks.eos_ids(eos_token_id, c.vocab_size)


@dataclasses.dataclass
class Prepared:
    """A padded batch ready for `_generate(static, *args)`; n = number of real prompts. With
    `static.auto`, args end with the placeholder costs (all 1) and force_k = -1 until
    `with_costs` fills in the measured costs."""

    static: Static
    args: tuple
    n: int
    lengths: np.ndarray
    costs: list[float] | None = None  # auto: the calibrated round costs

    def with_costs(self, costs: list[float]) -> "Prepared":
        """Auto with these round costs; or plain decoding when the rule picks k = 0 at the prior's
        acceptance: rounds at k = 0 measure nothing, so the counts stay empty and the rule would
        never leave k = 0. The plain loop then runs, without the MTP passes or the switch."""
        if int(best_k(AcceptanceCounts.zeros(self.static.k), jnp.asarray(costs, jnp.float32))) == 0:
            static = dataclasses.replace(self.static, k=0, auto=False)
            return dataclasses.replace(self, static=static, args=self.args[:-2] + (jnp.ones((1,)), jnp.int32(-1)),
                                       costs=costs)
        return dataclasses.replace(self, args=self.args[:-2] + (jnp.asarray(costs, jnp.float32), self.args[-1]),
                                   costs=costs)

    def limited(self, new_tokens: int) -> tuple:
        """args with at most new_tokens per row (as many as the cache bucket holds); 1 runs the
        prefill alone."""
        params, prompt, lengths, limits, *rest = self.args
        room = self.static.cache_len - int(self.lengths.max()) - self.static.k - 1
        return (params, prompt, lengths, jnp.full_like(limits, max(1, min(new_tokens, room))), *rest)

    def forced(self, k: int, new_tokens: int) -> tuple:
        """args for a calibration run: every round at k, at most new_tokens per row, no EOS."""
        params, prompt, lengths, limits, eos, sampling, key, real, costs, _ = self.limited(new_tokens)
        return params, prompt, lengths, limits, jnp.full_like(eos, -1), sampling, key, real, costs, jnp.int32(k)

    def cost_key(self) -> str:
        s = self.static
        return calibration.key(s.config.to_hf_config(), s.dtype, s.layout, s.mode, self.args[1].shape[0],
                               self.args[1].shape[1], s.cache_len, s.k)


def prepare(model: Model, prompts, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
            top_p: float = 1.0, speculative_k: int | str = 0, eos_token_id: int | Sequence[int] | None = None,
            seed: int = 0) -> Prepared:
    """Checks the arguments and pads the batch to its buckets (see `generate`)."""
    prompts, eos_ids = _check_arguments(model, prompts, max_new_tokens, temperature, top_k, top_p, speculative_k,
                                        eos_token_id, seed)
    model = model.decoding()
    auto = speculative_k == "auto"
    c, n = model.config, len(prompts)
    k = (AUTO_MAX_K if c.has_mtp else 0) if auto else int(speculative_k)
    top_k = 0 if top_k >= c.vocab_size else int(top_k)  # keeping the whole vocabulary is no filter
    lengths = np.array([len(p) for p in prompts], np.int32)
    batch, width = bucket(n, 1), bucket(int(lengths.max()), 16)
    limits = np.minimum(max_new_tokens, c.max_position_embeddings - lengths)
    cache_len = max(width, bucket(int((lengths + limits).max()) + k + 1, 64))
    prompt = np.zeros((batch, width), np.int32)
    for i, p in enumerate(prompts):
        prompt[i, :len(p)] = p
    pad = batch - n
    lengths = np.concatenate([lengths, np.ones(pad, np.int32)])
    limits = np.concatenate([limits, np.ones(pad, np.int32)]).astype(np.int32)
    real = np.arange(batch) < n
    static = Static(c, model.dtype, k, SamplingMode.of(temperature, top_k, top_p), cache_len, model.layout,
                    auto and k > 0)
    sampling = SamplingParams(jnp.float32(max(temperature, 1e-6)), jnp.int32(max(top_k, 1)), jnp.float32(top_p))
    # EOS ids padded with -1 (matches no token) to a bucket, so the id count rarely recompiles.
    eos = np.full(bucket(max(len(eos_ids), 1), 4), -1, np.int32)
    eos[:len(eos_ids)] = eos_ids
    rows = (prompt, lengths, limits, real)
    if model.mesh is not None:  # rows over the mesh's data axis
        from jaxmtp.sharding import batch_sharding, place, replicated

        rows = place(rows, tuple(batch_sharding(model.mesh, x.ndim) if batch % model.mesh.shape["data"] == 0
                                 else replicated(model.mesh) for x in rows))
    prompt, lengths_in, limits, real = rows
    args = (model.params, prompt, lengths_in, limits, eos, sampling, jax.random.key(seed), real,
            jnp.ones((k + 1,), jnp.float32), jnp.int32(-1))
    return Prepared(static, args, n, lengths)


def calibrated(prepared: Prepared, run) -> Prepared:
    """With auto: the round costs for this device, model and buckets (measured with `run`, the
    compiled loop, on first use; see jaxmtp.calibration) filled into the arguments."""
    if not prepared.static.auto:
        return prepared

    def timed(k, new_tokens):
        args = prepared.forced(k, new_tokens)
        start = time.perf_counter()
        out = jax.block_until_ready(run(*args))
        return time.perf_counter() - start, int(out[-1]) - 1  # out[-1]: main passes, the prefill's included

    return prepared.with_costs(calibration.round_costs(prepared.cost_key(), timed, prepared.static.k))


def generate(model: Model, prompts, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, speculative_k: int | str = 0, eos_token_id: int | Sequence[int] | None = None,
             seed: int = 0) -> GenerationOutput:
    """Generates up to max_new_tokens for each prompt, in one jitted loop.

    Args:
      prompts: token-id lists, any lengths (or a 2-D integer array [batch, length]).
      temperature: 0 = greedy (top_k / top_p then unused).
      top_k: 0 = off (as is any value >= the vocabulary). top_p: 1.0 = off.
      speculative_k: drafts per round from the MTP module (0 = plain decoding, up to 8), or "auto":
        each round chooses k in 0..AUTO_MAX_K from the measured cost of a round at each k on this
        device (jaxmtp.calibration, measured on first use and cached on disk) and the acceptance
        measured so far (jaxmtp.adaptive). Greedy output is identical to plain greedy; sampled
        output has the same distribution.
      eos_token_id: an id or a list of ids (as configs carry them): a row stops right after
        emitting any of them.
    A row also stops at max_position_embeddings tokens in all.
    """
    prepared = prepare(model, prompts, max_new_tokens, temperature, top_k, top_p, speculative_k, eos_token_id, seed)
    with model.mesh_context():
        prepared = calibrated(prepared, partial(_generate, prepared.static))
        return unpack(prepared, _generate(prepared.static, *prepared.args))


def timed_generate(model: Model, prompts, repeats: int = 1, **kwargs) -> tuple[GenerationOutput, float, list[float]]:
    """`generate` compiled ahead of time, so that compiling and running are timed apart.

    Returns (output, compile seconds, seconds of each of `repeats` runs of the compiled loop). With
    auto, a first calibration runs between compiling and the timed runs, counted in neither.
    """
    prepared = prepare(model, prompts, **kwargs)
    compile_seconds = 0.0

    def compiled(prepared):
        nonlocal compile_seconds
        start = time.perf_counter()
        run = _generate.lower(prepared.static, *prepared.args).compile()
        compile_seconds += time.perf_counter() - start
        return run

    with model.mesh_context():
        run = compiled(prepared)
        tuned = calibrated(prepared, run)
        if tuned.static != prepared.static:  # auto turned into the plain loop
            run = compiled(tuned)
        prepared = tuned
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            out = jax.block_until_ready(run(*prepared.args))
            seconds.append(time.perf_counter() - start)
    return unpack(prepared, out), compile_seconds, seconds


def unpack(prepared: Prepared, out) -> GenerationOutput:
    """`_generate`'s arrays -> the real rows' new tokens and the stats."""
    if not all(x.is_fully_addressable for x in out):  # a mesh spanning several processes
        from jax.experimental import multihost_utils

        out = multihost_utils.process_allgather(out, tiled=True)
    seq, count, rounds, drafted, accepted, accepted_at, rounds_at, steps = jax.device_get(out)
    n, lengths = prepared.n, prepared.lengths
    tokens = [seq[i, lengths[i]:lengths[i] + count[i]].tolist() for i in range(n)]
    stats = _stats(rounds[:n], drafted[:n], accepted[:n], accepted_at[:n], rounds_at[:n], int(steps))
    if prepared.costs is not None:
        stats["round_costs"] = prepared.costs
    return GenerationOutput(tokens, stats)


def _ratios(rounds, drafted, accepted, accepted_at, rounds_at) -> dict:
    drafting = rounds_at[::-1].cumsum()[::-1][1:]  # rounds that drafted at least i+1 tokens
    return {
        "acceptance_rate": float(accepted / drafted) if drafted else 0.0,
        "mean_accepted_length": float(1 + accepted / rounds) if rounds else 1.0,
        "per_position_acceptance": [float(a / d) if d else 0.0 for a, d in zip(accepted_at, drafting)],
        "draft_tokens": int(drafted),
        "accepted_tokens": int(accepted),
        "rounds_by_k": {k: int(r) for k, r in enumerate(rounds_at) if r},
    }


def _stats(rounds, drafted, accepted, accepted_at, rounds_at, steps) -> dict:
    """acceptance_rate = accepted / drafted; mean_accepted_length = tokens per verify round
    (1 + accepted / rounds); per_position_acceptance[i] = share of the rounds that drafted i+1 or
    more tokens in which draft i+1 was accepted; rounds_by_k = {k: rounds run at k};
    main_forward_passes counts the prefill. Overall, and per row under "per_row" (a row's passes
    are the prefill plus the rounds it was still running; the batch's are all rounds). With
    speculative_k="auto", round_costs = the calibrated cost of a round at k = 0.. in plain steps."""
    overall = _ratios(rounds.sum(), drafted.sum(), accepted.sum(), accepted_at.sum(axis=0), rounds_at.sum(axis=0))
    overall["main_forward_passes"] = steps
    overall["per_row"] = [dict(_ratios(r, d, a, at, rk), main_forward_passes=int(1 + r))
                          for r, d, a, at, rk in zip(rounds, drafted, accepted, accepted_at, rounds_at)]
    return overall
