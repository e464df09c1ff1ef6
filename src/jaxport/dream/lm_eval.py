"""`jaxport-dream`: Dream / DiffuCoder as a model of lm-evaluation-harness (`lm_eval`), decoded by jaxport.

    jaxport dream eval --model_args pretrained=DIR,max_new_tokens=256,diffusion_steps=256,add_bos_token=true \\
        --tasks gsm8k --num_fewshot 5 --batch_size 8

`jaxport dream eval` registers the model and runs lm-eval's own command line with the arguments as given
(`--model jaxport-dream` is added when no `--model` is). From Python, importing this module registers the
name for `lm_eval.simple_evaluate(model="jaxport-dream", model_args=...)`.

The model arguments are those of DreamLM/Dream's lm-eval model (`eval/eval.py`): `pretrained`,
`max_new_tokens`, `diffusion_steps`, `alg`, `temperature`, `top_p`, `top_k`, `alg_temp`,
`add_bos_token`, `escape_until`, `max_length`, `mc_num`, `sampling_eps`; with jaxport's fast decoding
`block_length`, `cache` (prefix or dual) and `threshold`, `early_stop` (default true: a batch stops decoding
once every row's text has ended, which changes no text), and `dtype`, `mesh` (`DATAxFSDPxMODEL`, as commas
separate the model arguments) and `seed`.
"""

import inspect
import itertools
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences
from tqdm import tqdm

from jaxport import dream, runtime
from jaxport.dream.config import DreamConfig
from jaxport.dream.params import parse_mesh
from jaxport.dream.settings import GenerationSettings, count
from jaxport.errors import JaxportError

MODEL_NAME = "jaxport-dream"


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not str(value).isdigit() or int(value) < 1:
        raise JaxportError(f"{MODEL_NAME} model argument {name}={value!r}: expected a positive integer")
    return int(value)


def length_bucket(length: int) -> int:
    """`length` rounded up to a multiple of 16, and of an eighth of its power of two above 128 (at most
    1/8 padding), so that the compiled forwards of `loglikelihood` stay few however the lengths vary."""
    step = max(2 ** (length.bit_length() - 4), 16)
    return -(-length // step) * step


def _weighted_nll(graphdef, state, noisy_BN, target_BN, weight_BN, attention_mask_BN):
    """Per row, the sum over positions of `weight * -log p(target | noisy)`; logits shift by one as the
    sampler's do (position j is scored from the hidden state at j - 1)."""
    logits_BNV = nnx.merge(graphdef, state).forward(noisy_BN, attention_mask_BN)
    logits_BNV = jnp.concatenate([logits_BNV[:, :1], logits_BNV[:, :-1]], axis=1)
    logp_BNV = jax.nn.log_softmax(logits_BNV.astype(jnp.float32), axis=-1)
    nll_BN = -jnp.take_along_axis(logp_BNV, target_BN[..., None], axis=-1)[..., 0]
    return (nll_BN * weight_BN).sum(axis=-1)


@register_model(MODEL_NAME)
class DreamLM(LM):
    """Dream / DiffuCoder in lm-eval: `generate_until` by diffusion decoding, `loglikelihood` by
    Dream's Monte-Carlo estimate.

    `generate_until`: the requests in batches of `batch_size`, in the order lm-eval gives them, each
    left-padded to the longest prompt of all requests (one compiled program per run) and followed by
    `max_new_tokens` masks, decoded by `model.diffusion_generate` in `diffusion_steps` steps (default
    `max_new_tokens`: one token per step) with `alg`, `temperature`, `top_p`, `top_k`, `alg_temp` and the
    fast-decoding `block_length`, `cache`, `threshold`; batch i draws from `fold_in(key(seed), i)`, and stops
    once every row's text has ended (`early_stop`, `diffusion_generate`'s early stop). The text is cut at
    end-of-text and then, unless `escape_until`, at the first of each request's `until`
    strings (lm-eval's). The canvas is the model's `max_new_tokens` whatever a task's `max_gen_toks`
    says, as in Dream's model. A prompt is never truncated: one too long for the model is an error.

    `loglikelihood`: Dream's `nll_type=mc, log_type=ftb` estimator (from SMDM): the context stays
    visible, the continuation (followed by end-of-text, which is never masked) is masked at a ratio
    `p = (1 - sampling_eps) t + sampling_eps`, each of its tokens independently, and
    `log p(continuation | context)` is bounded below by `-E_t[sum over masked tokens of -log p / p]`,
    averaged over `mc_num` samples whose `t` are stratified over [0, 1) (`t_k = (u + k / mc_num) mod 1`;
    Dream stratifies within each forward batch instead). `pad_continuation=true` follows the
    continuation with end-of-text up to `max_new_tokens` tokens (visible, never scored) instead of one:
    the layout of the generation canvas and of answers in fixed spans padded with end-of-text, as
    supervised fine-tuning (and the sort task's test model) trains on. The draws are seeded by `seed` and the context
    text alone, so the choices of one question share them (common random numbers) and the result does
    not depend on batching or order. `batch_size` rows (samples of one or more requests) run per
    forward. `is_greedy` is always False, as in Dream's model. `loglikelihood_rolling` is not
    implemented, as in Dream's.
    """

    def __init__(
        self,
        pretrained: str,
        batch_size: int | str = 1,
        dtype: str = "auto",
        mesh: str | None = None,
        max_new_tokens: int = 128,
        max_length: int = 2048,
        diffusion_steps: int | None = None,
        alg: str = "entropy",
        temperature: float = 0.0,
        top_p: float | None = None,
        top_k: int | None = None,
        alg_temp: float | None = None,
        block_length: int | None = None,
        cache: str | None = None,
        threshold: float | None = None,
        early_stop: bool = True,
        add_bos_token: bool = False,
        escape_until: bool = False,
        mc_num: int = 128,
        pad_continuation: bool = False,
        sampling_eps: float = 1e-3,
        seed: int = 0,
        device: str | None = None,  # lm-eval's --device: JAX places the model on its default devices
        max_batch_size: int | None = None,  # lm-eval's --max_batch_size, for batch_size=auto (not supported)
        trust_remote_code: bool | None = None,  # lm-eval's --trust_remote_code: jaxport runs no code of the model's
        **unknown,
    ):
        super().__init__()
        if unknown:
            known = [name for name in inspect.signature(DreamLM).parameters if name != "unknown"]
            raise JaxportError(
                f"{MODEL_NAME}: unknown model argument(s) {', '.join(sorted(unknown))}; known: {', '.join(known)}"
            )
        self.batch_size = _positive_int("batch_size", batch_size)
        self.max_new_tokens = _positive_int("max_new_tokens", max_new_tokens)
        self.max_length = _positive_int("max_length", max_length)
        self.mc_num = _positive_int("mc_num", mc_num)
        if not 0 < float(sampling_eps) < 1:
            raise JaxportError(
                f"{MODEL_NAME} model argument sampling_eps={sampling_eps!r}: expected a number in (0, 1)"
            )
        self.sampling_eps = float(sampling_eps)
        self.add_bos_token = bool(add_bos_token)
        self.escape_until = bool(escape_until)
        self.pad_continuation = bool(pad_continuation)
        self.seed = int(seed)
        if dtype == "auto":
            dtype = DreamConfig.from_model_dir(pretrained).torch_dtype
        mesh = parse_mesh(str(mesh).replace("x", ",")) if mesh else None
        self.pretrained = str(pretrained)
        self.sampling = {
            "steps": self.max_new_tokens if diffusion_steps is None else count("diffusion_steps", diffusion_steps),
            "alg": alg,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "alg_temp": alg_temp,
            "block_length": block_length,
            "cache": cache,
            "threshold": threshold,
            "early_stop": early_stop,
        }
        GenerationSettings.of(**self.sampling).check(self.max_new_tokens)  # before the model loads
        self.model, self.tokenizer = dream.load(pretrained, dtype=dtype, mesh=mesh)
        if self.add_bos_token and "bos_token" not in self.tokenizer.special:
            raise JaxportError(f"{pretrained}: add_bos_token=true, but tokenizer_config.json names no bos_token")

    @property
    def tokenizer_name(self) -> str:
        return self.pretrained.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str:
        return self.tokenizer.chat_template or ""

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt)

    def _with_bos(self, text: str) -> str:
        return self.tokenizer.special["bos_token"] + text if self.add_bos_token else text

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        if not requests:
            return []
        prompts = [self._with_bos(request.args[0]) for request in requests]
        width = max(len(self.tokenizer.encode(prompt)) for prompt in prompts)
        eos = self.tokenizer.decode([self.tokenizer.eos_token_id])
        key = jax.random.key(self.seed)
        answers = []
        for first in tqdm(
            range(0, len(prompts), self.batch_size),
            desc="generate_until (batches)",
            disable=disable_tqdm,
        ):
            batch = prompts[first : first + self.batch_size]
            # a short last batch repeats its first prompt, so it runs the same compiled program
            input_ids, attention_mask = self.tokenizer(batch + batch[:1] * (self.batch_size - len(batch)), pad_to=width)
            sequences = self.model.diffusion_generate(
                input_ids,
                attention_mask,
                max_new_tokens=self.max_new_tokens,
                rng=jax.random.fold_in(key, first // self.batch_size),
                return_dict_in_generate=False,
                stop_token_ids=self.tokenizer.stop_ids,
                **self.sampling,
            )
            texts = self.tokenizer.decode_generation(jax.device_get(sequences), width)[: len(batch)]
            for request, text in zip(requests[first : first + self.batch_size], texts):
                if not self.escape_until:
                    for stop in handle_stop_sequences(request.args[1].get("until"), eos):
                        if stop:
                            text = text.split(stop)[0]
                self.cache_hook.add_partial("generate_until", request.args, text)
                answers.append(text)
        return answers

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int], list[int]]:
        """Token ids `(context, continuation, end-of-text tail)` as Dream's model splits them: trailing
        spaces of the context move to the continuation, the pair is encoded whole, one end-of-text
        follows (up to `max_new_tokens` tokens in all with `pad_continuation`), and the front of the
        context is cut when the whole is longer than `max_length`."""
        context = self._with_bos(context)
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        context_ids = self.tokenizer.encode(context)
        continuation_ids = self.tokenizer.encode(context + continuation)[len(context_ids) :]
        if not continuation_ids:
            raise JaxportError(f"loglikelihood: empty continuation after context {context[-80:]!r}")
        tail = [self.tokenizer.eos_token_id] * max(
            self.max_new_tokens - len(continuation_ids) if self.pad_continuation else 1, 1
        )
        keep = self.max_length - len(continuation_ids) - len(tail)
        if keep < 0:
            raise JaxportError(
                f"loglikelihood: the continuation and its end-of-text take {len(continuation_ids) + len(tail)} "
                f"tokens, more than max_length={self.max_length}"
            )
        return context_ids[max(len(context_ids) - keep, 0) :], continuation_ids, tail

    def _mc_rows(self, context: str, context_ids, continuation_ids, tail):
        """The `mc_num` noisy copies of one request: `(sequence [L], noisy [M, L], weight [M, L])`, the
        weight 1/p on the masked continuation tokens and 0 elsewhere."""
        rng = np.random.default_rng([self.seed, zlib.crc32(context.encode())])
        sequence = np.asarray(context_ids + continuation_ids + tail, np.int32)
        # the context and the end-of-text tail stay visible, and the first position (nothing left of it
        # to score it from), as in Dream's
        span = slice(max(len(context_ids), 1), len(context_ids) + len(continuation_ids))
        t_M = (rng.random() + np.arange(self.mc_num) / self.mc_num) % 1.0
        p_M = (1 - self.sampling_eps) * t_M + self.sampling_eps
        masked_MS = rng.random((self.mc_num, span.stop - span.start)) < p_M[:, None]
        noisy_ML = np.tile(sequence, (self.mc_num, 1))
        weight_ML = np.zeros(noisy_ML.shape, np.float32)
        noisy_ML[:, span] = np.where(masked_MS, self.tokenizer.mask_token_id, noisy_ML[:, span])
        weight_ML[:, span] = masked_MS / p_M[:, None]
        return sequence, noisy_ML, weight_ML

    def _noisy_rows(self, requests, pairs, order):
        """`(request index, sequence, noisy row, weight row)` for every Monte-Carlo sample, request by
        request in `order`, made as they are consumed (all of them at once may not fit in memory)."""
        for index in order:
            sequence, noisy_ML, weight_ML = self._mc_rows(requests[index].args[0], *pairs[index])
            for noisy, weight in zip(noisy_ML, weight_ML):
                yield index, sequence, noisy, weight

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self._encode_pair(*request.args) for request in requests]
        # longest first, so that each batch is padded to the length of its first row
        order = sorted(range(len(requests)), key=lambda i: -sum(len(ids) for ids in pairs[i]))
        rows = self._noisy_rows(requests, pairs, order)
        totals = np.zeros(len(requests))
        graphdef, state = nnx.split(self.model)
        batches = -(-len(requests) * self.mc_num // self.batch_size)
        for _ in tqdm(range(batches), desc="loglikelihood (batches)", disable=disable_tqdm):
            chunk = list(itertools.islice(rows, self.batch_size))
            width = length_bucket(len(chunk[0][1]))
            noisy_BN = np.full((self.batch_size, width), self.tokenizer.pad_token_id, np.int32)
            target_BN = np.zeros((self.batch_size, width), np.int32)
            weight_BN = np.zeros((self.batch_size, width), np.float32)
            attention_BN = np.ones((self.batch_size, width), np.int32)  # filler rows: all pad, weight 0
            for row, (_, sequence, noisy, weight) in enumerate(chunk):
                pad = width - len(sequence)
                noisy_BN[row, pad:], target_BN[row, pad:], weight_BN[row, pad:] = noisy, sequence, weight
                attention_BN[row, :pad] = 0
            batch = self.model.place_batch(noisy_BN, target_BN, weight_BN, attention_BN)
            program_runtime = runtime.for_tokens(batch[0], self.model.dtype)
            weighted_nll = runtime.jit_once(_weighted_nll, program_runtime, static_argnums=0)
            nll_B = weighted_nll(graphdef, state, *batch)
            for (index, *_), nll in zip(chunk, np.asarray(jax.device_get(nll_B))):
                totals[index] += nll
        results = []
        for request, total in zip(requests, totals):
            result = (-float(total) / self.mc_num, False)
            self.cache_hook.add_partial("loglikelihood", request.args, result)
            results.append(result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        raise NotImplementedError(f"{MODEL_NAME} has no rolling log-likelihood (perplexity), as Dream's model has none")


def cli(argv: list[str]) -> int:
    """`jaxport dream eval ARGS`: lm-eval's command line (`lm-eval ARGS`) with `jaxport-dream` registered
    and, for a run that names no `--model`, chosen."""
    from lm_eval.__main__ import cli_evaluate

    args = list(argv)
    command = 1 if args[:1] == ["run"] else 0
    runs = not args or args[0] not in ("ls", "validate", "-h", "--help")
    named = any(arg in ("--model", "-M", "--config", "-C") or arg.startswith(("--model=", "--config=")) for arg in args)
    if runs and not named:
        args[command:command] = ["--model", MODEL_NAME]
    saved, sys.argv = sys.argv, ["lm-eval", *args]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return 0
