"""`generate` and `generate_stream`: the host side of generation around the compiled loop
(`jaxmtp.decoding`): checking the arguments, padding the batch into buckets, calibrating
speculative_k="auto", running the loop and unpacking what it returns.

Shapes are padded to buckets (batch, prompt length, cache length, stop-sequence table) so that new
prompt lengths reuse a compiled function; everything else (lengths, limits, stop sequences,
sampling values, seed) is traced.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp import adaptive, calibration, checks, compile_cache, streaming
from jaxmtp.decoding import ANY, AUTO_SEGMENT, NEVER, DecodeState, Inputs, Static, advance, start
from jaxmtp.errors import ArgumentTypeError, InputError
from jaxmtp.generation_config import GenerationConfig
from jaxmtp.layout import CHECKPOINT, platform
from jaxmtp.model import Model
from jaxmtp.sampling import SamplingMode, SamplingParams
from jaxmtp.stats import GenerationStats

MAX_SPECULATIVE_K = 8
# speculative_k="auto" chooses among k = 0..AUTO_MAX_K, on a CPU among k = 0..AUTO_MAX_K_CPU. Each k
# is a round variant that the auto loop compiles and calibration times, which a machine's first run
# waits for (benchmarks/compile_cache.py). No `jaxmtp bench` run of the demo found k = 4 the fastest
# fixed k, and none on a CPU found k = 3 faster than k = 2 (docs/performance.md).
AUTO_MAX_K = 3
AUTO_MAX_K_CPU = 2
# Streaming runs the loop in chunks of loop steps: 1, 2, 4, ... until a chunk takes this long, so
# that the first tokens come after the prefill and one round, and the later chunks' cost of a host
# round trip (about half a millisecond on a CPU) is small beside their run time.
CHUNK_SECONDS = 0.05
MAX_CHUNK_STEPS = 4096
ALL_STEPS = 2**31 - 1


@dataclasses.dataclass
class GenerationOutput:
    """tokens: the new tokens of each prompt (up to and including the token that stopped it).
    stats: `GenerationStats`. logprobs: with return_logprobs, each token's log-probability under
    the main model's distribution it was chosen from (the raw softmax when greedy), else None."""

    tokens: list[list[int]]
    stats: GenerationStats
    logprobs: list[list[float]] | None = None


def auto_max_k(model: Model) -> int:
    """The most drafts per round that speculative_k="auto" chooses from for this model's platform."""
    return AUTO_MAX_K_CPU if platform(model.params, model.mesh) == "cpu" else AUTO_MAX_K


def bucket(n: int, smallest: int) -> int:
    """The padded size for n: a power of two >= smallest, then multiples of 1024 past 1024."""
    if n > 1024:
        return -(-n // 1024) * 1024
    return max(smallest, 1 << (n - 1).bit_length())


def prompt_width(longest: int, chunk: int) -> int:
    """The padded prompt width for prompts of up to `longest` tokens: its bucket, rounded up to a
    whole number of prefill chunks where it is wider than one."""
    width = bucket(longest, 16)
    return width if width <= chunk else -(-width // chunk) * chunk


def options(config: GenerationConfig | None, overrides: dict) -> GenerationConfig:
    """`config` (default GenerationConfig()) with keyword arguments over it."""
    if config is not None and not isinstance(config, GenerationConfig):
        raise ArgumentTypeError(f"config: expected a GenerationConfig, found {type(config).__name__}")
    return (config or GenerationConfig()).replace(**overrides)


def _check(model: Model, prompts, g: GenerationConfig):
    """Refuses bad arguments with a message naming them -> (prompts as lists of ints, stop
    sequences: the EOS ids as sequences of one, then stop_token_ids)."""
    c = model.config
    prompts = checks.prompts(prompts, c.vocab_size)
    for i, p in enumerate(prompts):
        if len(p) >= c.max_position_embeddings:
            raise InputError(f"prompts[{i}]: {len(p)} tokens leave no room for a new one within "
                             f"max_position_embeddings = {c.max_position_embeddings}")
    checks.whole("max_new_tokens", g.max_new_tokens, minimum=1)
    checks.real("temperature", g.temperature, minimum=0)
    checks.whole("top_k", g.top_k, minimum=0)
    checks.real("top_p", g.top_p, minimum=0, maximum=1, above_minimum=True)
    checks.whole("seed", g.seed)
    checks.whole("prefill_chunk", g.prefill_chunk, minimum=16)
    if g.prefill_chunk % 16:
        raise InputError(f"prefill_chunk: expected a multiple of 16, found {g.prefill_chunk}")
    checks.stop_strings(g.stop)
    if not isinstance(g.return_logprobs, bool):
        raise ArgumentTypeError(f"return_logprobs: expected True or False, found {g.return_logprobs!r}")
    k = g.speculative_k
    if k != "auto":
        if isinstance(k, str):
            raise InputError(f'speculative_k: expected "auto" or an integer 0..{MAX_SPECULATIVE_K}, found {k!r}')
        checks.whole("speculative_k", k, minimum=0, maximum=MAX_SPECULATIVE_K)
    if k not in (0, "auto") and not c.has_mtp:
        raise InputError("speculative_k > 0 needs an MTP module; this model has num_nextn_predict_layers = 0")
    eos = tuple((i,) for i in checks.eos_ids(g.eos_token_id, c.vocab_size))
    return prompts, eos + checks.stop_sequences(g.stop_token_ids, c.vocab_size)


def _stop_table(sequences) -> np.ndarray:
    """Stop sequences -> [N, L] right-aligned, left-padded with ANY, unused rows NEVER; N and L
    padded to buckets of at least 4, so that up to 4 sequences of up to 4 tokens (EOS ids
    included) share one compiled loop."""
    length = bucket(max((len(s) for s in sequences), default=1), 4)
    table = np.full((bucket(max(len(sequences), 1), 4), length), NEVER, np.int32)
    for row, s in zip(table, sequences):
        row[:] = ANY
        row[length - len(s):] = s
    return table


@dataclasses.dataclass
class Prepared:
    """A padded batch ready for the compiled loop (`run`, `chunks`); n = number of real prompts,
    lengths their lengths. With `static.auto`, inputs carry placeholder costs (all 1) and force_k =
    -1 until `with_costs` fills in the measured costs."""

    static: Static
    params: dict
    inputs: Inputs
    n: int
    lengths: np.ndarray
    costs: list[float] | None = None  # auto: the calibrated round costs
    chose_plain: bool = False  # auto: no k pays at these costs, so the plain loop runs

    def with_costs(self, costs: list[float]) -> "Prepared":
        """Auto with these round costs (in steps of the plain loop), one per k in 0..static.k."""
        if len(costs) != self.static.k + 1:
            raise InputError(f"round costs: expected {self.static.k + 1} (k = 0..{self.static.k}), found {len(costs)}")
        return dataclasses.replace(self, inputs=self.inputs.replace(costs=np.asarray(costs, np.float32)),
                                   costs=costs)

    def plain(self) -> "Prepared":
        """The same batch for the plain decoding loop (k = 0, no auto)."""
        static = dataclasses.replace(self.static, k=0, auto=False)
        inputs = self.inputs.replace(costs=np.ones((1,), np.float32), force_k=np.int32(-1))
        return dataclasses.replace(self, static=static, inputs=inputs)

    def limited(self, new_tokens: int) -> Inputs:
        """Inputs with at most new_tokens per row (as many as the cache bucket holds); 1 runs the
        prefill alone."""
        room = self.static.cache_len - int(self.lengths.max()) - self.static.k - 1
        limits = np.full(self.inputs.limits.shape, max(1, min(new_tokens, room)), np.int32)
        return self.inputs.replace(limits=_placed_like(limits, self.inputs.limits))

    def forced(self, k: int, new_tokens: int) -> Inputs:
        """Inputs for a calibration run: every round at k, at most new_tokens per row, no stops."""
        if not 0 <= k <= self.static.k:
            raise InputError(f"forced k: expected 0..{self.static.k}, the auto loop's round variants; found {k}")
        inputs = self.limited(new_tokens)
        return inputs.replace(stops=np.full_like(inputs.stops, NEVER), force_k=np.int32(k))

    def cost_key(self) -> str:
        s, prompt = self.static, self.inputs.prompt
        return _cost_key(s, prompt.shape[0], prompt.shape[1])

    def run(self, inputs: Inputs | None = None) -> DecodeState:
        """The compiled loop on `inputs` (default the prepared ones), to the end."""
        inputs = self.inputs if inputs is None else inputs
        state = start(self.static, self.params, inputs)
        return advance(self.static, self.params, state, inputs, jnp.int32(ALL_STEPS), _no_halt(inputs))[0]

    def chunks(self, receiver: streaming.Receiver):
        """The loop a chunk of steps at a time (see CHUNK_SECONDS): yields each real row's newly
        committed tokens after the prefill and after every chunk (`receiver.receive`; rows that
        its stop strings end are halted from a later chunk on); returns the final state.

        Two chunks are kept in flight: while the host reads one chunk's tokens, the next already
        runs, so the device does not wait for the host between chunks."""
        state = start(self.static, self.params, self.inputs)
        pending = [(state.tokens.seq, state.tokens.count, state.tokens.done)]  # tokens not yet read, oldest first
        halt = np.zeros(self.inputs.real.shape, bool)
        steps, began = 0, time.perf_counter()  # steps of the last chunk queued (0: none yet)
        while True:
            seq, count, done = _fetch(pending.pop(0))
            now = time.perf_counter()
            quick = _as_process_0(now - began < CHUNK_SECONDS)  # the same chunks on every process
            steps = max(1, min(2 * steps, MAX_CHUNK_STEPS) if quick else steps)
            began = now
            new = receiver.receive(seq, self.lengths, count)
            halt |= receiver.halted(len(done))
            finished = np.all(done | halt)
            while not finished and len(pending) < 2:
                state, tokens = advance(self.static, self.params, state, self.inputs, jnp.int32(steps),
                                        _placed_like(halt, self.inputs.real))
                pending.append(tokens)
            yield new
            if finished:  # chunks still queued run no step: every row is done
                return state


@functools.lru_cache(maxsize=64)
def _cost_key(static: Static, batch: int, width: int) -> str:
    """calibration.key for a loop's static configuration and buckets (kept: generate asks on every call)."""
    s = static
    return calibration.key(s.config.to_hf_config(), s.dtype, s.layout, s.mode, batch, width, s.cache_len, s.k)


def _placed_like(rows: np.ndarray, like):
    """rows [B] placed as `like`'s rows are: over the mesh as `prepare` placed them, or a host array
    where it left them one. A jitted loop compiles once per placement of its arguments (an array
    made inside `jax.set_mesh` is placed on the mesh, one made outside is not), so the inputs of
    the calibration runs, the decoding run and every streamed chunk are placed alike, and one
    compiled loop serves them all."""
    return jax.device_put(rows, like.sharding) if isinstance(like, jax.Array) else rows


def _no_halt(inputs: Inputs):
    """halt [B] for a loop that the host stops no row of, placed as a chunk's (see _placed_like)."""
    return _placed_like(np.zeros(inputs.real.shape, bool), inputs.real)


def _as_process_0(flag: bool) -> bool:
    """flag as process 0 has it, on every process (a collective where there are several): a
    choice read from a clock sets how many steps the next chunk runs, and every process must run
    as many, since each step launches collectives."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.bool_(flag)))


def _fetch(arrays):
    """Device arrays -> numpy, gathered from every process where a mesh spans several."""
    if not all(x.is_fully_addressable for x in jax.tree.leaves(arrays)):
        from jax.experimental import multihost_utils

        arrays = multihost_utils.process_allgather(arrays, tiled=True)
    return jax.device_get(arrays)


def prepare(model: Model, prompts, config: GenerationConfig | None = None, **overrides) -> Prepared:
    """Checks the arguments and pads the batch to its buckets (see `generate`)."""
    g = options(config, overrides)
    _refuse_v4(model)
    prompts, stops = _check(model, prompts, g)
    compile_cache.enable()
    model = model.decoding()
    auto = g.speculative_k == "auto"
    c, n = model.config, len(prompts)
    k = (auto_max_k(model) if c.has_mtp else 0) if auto else int(g.speculative_k)
    top_k = 0 if g.top_k >= c.vocab_size else int(g.top_k)  # keeping the whole vocabulary is no filter
    lengths = np.array([len(p) for p in prompts], np.int32)
    batch, width = bucket(n, 1), prompt_width(int(lengths.max()), g.prefill_chunk)
    limits = np.minimum(g.max_new_tokens, c.max_position_embeddings - lengths)
    cache_len = max(width, bucket(int((lengths + limits).max()) + k + 1, 64))
    prompt = np.zeros((batch, width), np.int32)
    for i, p in enumerate(prompts):
        prompt[i, :len(p)] = p
    pad = batch - n
    lengths = np.concatenate([lengths, np.ones(pad, np.int32)])
    limits = np.concatenate([limits, np.ones(pad, np.int32)]).astype(np.int32)
    real = np.arange(batch) < n
    static = Static(c, model.dtype, k, SamplingMode.of(g.temperature, top_k, g.top_p), cache_len, model.layout,
                    auto=auto and k > 0, logprobs=g.return_logprobs, prefill_chunk=g.prefill_chunk)
    rows = (prompt, lengths, limits, real)
    if model.mesh is not None:  # rows over the mesh's data axis
        from jaxmtp.sharding import batch_sharding, place, replicated

        rows = place(rows, tuple(batch_sharding(model.mesh, x.ndim) if batch % model.mesh.shape["data"] == 0
                                 else replicated(model.mesh) for x in rows))
    prompt, lengths_in, limits, real = rows
    sampling = SamplingParams(jnp.float32(max(g.temperature, 1e-6)), jnp.int32(max(top_k, 1)), jnp.float32(g.top_p))
    # The table, costs and force_k stay host arrays, as `forced`, `with_costs` and `plain` make
    # them, so that calibrating and decoding run one compiled loop (see _placed_like).
    inputs = Inputs(prompt=prompt, lengths=lengths_in, limits=limits, real=real, stops=_stop_table(stops),
                    sampling=sampling, key=jax.random.key(g.seed), costs=np.ones((k + 1,), np.float32),
                    force_k=np.int32(-1))
    return Prepared(static, model.params, inputs, n, lengths)


def seconds_per_round(run: Prepared, inputs: Inputs, steps: int = ALL_STEPS) -> float:
    """Seconds per round (main forward) over up to `steps` loop steps of `run` on `inputs`, the
    prefill before them not timed."""
    state = jax.block_until_ready(start(run.static, run.params, inputs))
    began = time.perf_counter()
    state, _ = jax.block_until_ready(advance(run.static, run.params, state, inputs, jnp.int32(steps),
                                             _no_halt(inputs)))
    return (time.perf_counter() - began) / max(int(state.stats.steps) - 1, 1)  # steps: the prefill's included


def calibration_runs(prepared: Prepared):
    """For an auto batch: (plain_seconds(), round_seconds(k)) as jaxmtp.calibration.measure takes
    them: about calibration.ROUNDS steps of the plain loop, or rounds of the auto loop with k forced
    (a token limit with room for ROUNDS full acceptances)."""
    plain = prepared.plain()
    segments = -(-calibration.ROUNDS // AUTO_SEGMENT)  # a loop step of the auto loop is a segment
    return (lambda: seconds_per_round(plain, plain.forced(0, calibration.ROUNDS), calibration.ROUNDS),
            lambda k: seconds_per_round(prepared, prepared.forced(k, calibration.ROUNDS * (k + 1)), segments))


def _silent(message: str):
    pass


def calibrated(prepared: Prepared, progress=_silent) -> Prepared:
    """With auto: the round costs for this device, model and buckets (measured with the compiled
    loops on first use, in steps of the plain loop; see jaxmtp.calibration) filled into the inputs;
    where no k > 0 pays at the prior's acceptance (`adaptive.drafting_pays`), the plain loop, which
    is what the auto loop would run, at the plain loop's speed. progress(message) hears of the
    compiling and measuring, where they happen. With several processes, every process takes
    process 0's costs (stored or measured; see jaxmtp.calibration), so all decode the same k in
    every round and take the same loop."""
    if not prepared.static.auto:
        return prepared
    key, k_max = prepared.cost_key(), prepared.static.k
    costs = calibration.stored(key, k_max)
    if costs is None:
        progress(COMPILING)
        measuring = (f"measuring what a round drafting k = 0..{k_max} tokens costs on this machine (once per machine, "
                     "model and shape)")
        costs = calibration.measured(key, *calibration_runs(prepared), k_max, warmed=lambda: progress(measuring))
    prepared = prepared.with_costs(costs)
    return prepared if adaptive.drafting_pays(costs) else dataclasses.replace(prepared.plain(), chose_plain=True)


def unpack(prepared: Prepared, state: DecodeState, receiver: streaming.Receiver | None = None) -> GenerationOutput:
    """The final state -> the real rows' new tokens (and log-probabilities) and the stats; with a
    receiver, each row's tokens are the ones it received (cut at its stop string)."""
    n, lengths = prepared.n, prepared.lengths
    t, s = state.tokens, state.stats
    out = _fetch({"seq": t.seq, "logprobs": t.logprobs, "count": t.count, "rounds": s.rounds, "drafted": s.drafted,
                  "accepted": s.accepted, "accepted_at": s.accepted_at, "rounds_at": s.rounds_at, "steps": s.steps})
    count = out["count"] if receiver is None else [len(t) for t in receiver.tokens]
    spans = [slice(lengths[i], lengths[i] + count[i]) for i in range(n)]
    tokens = [out["seq"][i, span].tolist() for i, span in enumerate(spans)]
    logprobs = out["logprobs"]
    if logprobs is not None:
        logprobs = [logprobs[i, span].tolist() for i, span in enumerate(spans)]
    stats = GenerationStats.of(out["rounds"][:n], out["drafted"][:n], out["accepted"][:n], out["accepted_at"][:n],
                               out["rounds_at"][:n], out["steps"], prepared.costs, prepared.chose_plain)
    return GenerationOutput(tokens, stats, logprobs)


def generate(model: Model, prompts, config: GenerationConfig | None = None, *, tokenizer=None,
             **options_) -> GenerationOutput:
    """Generates up to max_new_tokens for each prompt: the jitted prefill, then every round in one
    jitted `lax.while_loop` on device.

    Args:
      prompts: token-id lists, any lengths (or a 2-D integer array [batch, length]).
      config: a `GenerationConfig`; its fields can also be given (or overridden) as keyword
        arguments: max_new_tokens, temperature, top_k, top_p, speculative_k, eos_token_id,
        stop_token_ids, stop, seed, return_logprobs. speculative_k="auto" chooses k in
        0..`auto_max_k(model)` (3, or 2 on a CPU) as it goes, from the measured cost of a round at
        each k on this device (jaxmtp.calibration, measured on first use and cached on disk) and
        the acceptance so far (jaxmtp.adaptive). Greedy output is identical to plain greedy; sampled output has the
        same distribution.
      tokenizer: decodes tokens for `stop` strings (anything with decode(ids) -> str).
    A row also stops at max_position_embeddings tokens in all. A DeepSeek-V4 model (`load_v4`)
    decodes through its own compiled rounds instead (jaxmtp.models.deepseek_v4.api), with the same fields.
    """
    g = options(config, options_)
    if _v4(model):
        from jaxmtp.models.deepseek_v4 import api

        return api.generate(model, prompts, g, tokenizer)
    prepared = prepare(model, prompts, g)
    receiver = streaming.Receiver(prepared.n, tokenizer, g.stop) if g.stop else None  # refuses a missing tokenizer
    with model.mesh_context():
        prepared = calibrated(prepared)
        if receiver is None:
            return unpack(prepared, prepared.run())
        chunks = prepared.chunks(receiver)
        while True:
            try:
                next(chunks)
            except StopIteration as end:
                return unpack(prepared, end.value, receiver)


class TokenStream:
    """What `generate_stream` returns. Iterating yields lists of newly committed token ids (plain
    ints, possibly empty) after the prefill and after each chunk of rounds, while the loop runs;
    the generator's return value is the finished run's `GenerationStats`, and `output` then holds
    the whole `GenerationOutput`. Leaving the iteration early stops the loop there. Iterate once."""

    def __init__(self, model: Model, prepared: Prepared, tokenizer, stop):
        self._model, self._prepared = model, prepared
        self.receiver = streaming.Receiver(1, tokenizer, stop)
        self.output: GenerationOutput | None = None

    @property
    def stats(self) -> GenerationStats | None:
        return None if self.output is None else self.output.stats

    def text(self, final: bool = True) -> str:
        """The decoded text so far, cut before a stop string (see `streaming.Receiver.text`)."""
        return self.receiver.text(0, final)

    def __iter__(self) -> Iterator[list[int]]:
        # The model's mesh is set while the loop runs, not while the caller holds the tokens.
        with self._model.mesh_context():
            prepared = calibrated(self._prepared)
            chunks = prepared.chunks(self.receiver)
        while True:
            try:
                with self._model.mesh_context():
                    (new,) = next(chunks)
            except StopIteration as end:
                with self._model.mesh_context():
                    self.output = unpack(prepared, end.value, self.receiver)
                return self.output.stats
            yield new


def generate_stream(model: Model, prompt, config: GenerationConfig | None = None, *, tokenizer=None,
                    **options_) -> TokenStream:
    """`generate` for one prompt (a list of token ids), yielding each round's new tokens as the
    loop commits them; the concatenated stream equals `generate`'s tokens. Arguments are checked
    here, before anything runs; see `TokenStream` and `jaxmtp.streaming` (the loop runs in chunks
    of steps, see CHUNK_SECONDS; the same compiled functions as `generate`'s)."""
    g = options(config, options_)
    if _v4(model):
        from jaxmtp.models.deepseek_v4 import api

        return api.V4TokenStream(model, prompt, g, tokenizer)
    return TokenStream(model, prepare(model, [prompt], g), tokenizer, g.stop)


def _refuse_v4(model):
    """What only the V3 family's compiled loop does refuses a DeepSeek-V4 model, saying why."""
    if _v4(model):
        raise InputError("model: a DeepSeek-V4 model decodes through its own loop (jaxmtp.generate, generate_stream); "
                         "prepare, warm_up and timed_generate run the V3 family's compiled loop only")


def _v4(model) -> bool:
    """Whether `model` is a DeepSeek-V4 model (jaxmtp.models.deepseek_v4.V4Model), which decodes
    through its own loop (its module imported only then)."""
    if isinstance(model, Model):
        return False
    from jaxmtp.models.deepseek_v4.model import V4Model

    return isinstance(model, V4Model)


def _warmed(prepared: Prepared, progress=_silent) -> Prepared:
    """Compiles (and with auto, calibrates) the loop for these buckets, then runs its prefill and
    one round at each k it may take: XLA's CPU programs run a branch slower the first time than
    later, which would otherwise land in the first call's timing and its first tokens. -> the
    prepared batch with auto's costs filled in."""
    prepared = calibrated(prepared, progress)
    if not prepared.static.auto and not prepared.chose_plain:  # auto compiled its loops to measure them
        progress(COMPILING)
    if prepared.static.auto:
        runs = [prepared.forced(k, k + 2) for k in range(prepared.static.k + 1)]
    else:
        runs = [prepared.limited(2)]
    for inputs in runs:
        jax.block_until_ready(prepared.run(inputs))
    return prepared


# What warm_up tells its progress callback while it compiles.
COMPILING = "compiling the decoding loops for this machine (once: later runs load them from the compile cache)"


def warm_up(model: Model, prompts, config: GenerationConfig | None = None, progress=_silent, **options_) -> float:
    """Compiles (and with auto, calibrates) the loop for each prompt's buckets by running its
    prefill alone, so that later calls only run; -> seconds taken. With the compile cache
    (jaxmtp.compile_cache), a later process mostly loads what this one compiled. progress(message)
    is told of each stage as it starts (the weights' decode layout, compiling, measuring costs)."""
    g = options(config, options_)
    _refuse_v4(model)
    start = time.perf_counter()
    if model.layout == CHECKPOINT:
        progress("arranging the weights in the decode layout")
        model.decoding()
    with model.mesh_context():
        for p in prompts:
            _warmed(prepare(model, [p], g), progress)
    return time.perf_counter() - start


def timed_generate(model: Model, prompts, config: GenerationConfig | None = None, repeats: int = 1,
                   **options_) -> tuple[GenerationOutput, float, list[float]]:
    """`generate` with compiling and running timed apart: -> (output, seconds of the warm-up that
    compiles the loop (and with auto, calibrates), seconds of each of `repeats` runs)."""
    g = options(config, options_)
    prepared = prepare(model, prompts, g)
    with model.mesh_context():
        start = time.perf_counter()
        prepared = _warmed(prepared)
        compile_seconds = time.perf_counter() - start
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            out = jax.block_until_ready(prepared.run())
            seconds.append(time.perf_counter() - start)
    return unpack(prepared, out), compile_seconds, seconds
