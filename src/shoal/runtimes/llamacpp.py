"""`llamacpp`: GGUF models on llama.cpp, decoding many sequences in one batch.

It uses llama-cpp-python's low-level API, because its high-level `Llama` object decodes one
sequence at a time. One context holds `max_sequences` sequences (`n_seq_max`, with a unified
KV cache); every step builds one shared `llama_batch` with the last token of each running
sequence plus a chunk of any new prompt, decodes it once, and samples each sequence from its
own logits with its own sampler chain (so seeds are per request).

LoRA: llama.cpp applies adapters to a whole context, not per sequence. Sequences of one
adapter (or of the base) are decoded together, one `llama_decode` per adapter present in the
step, switching the context's adapter in between; they share the one KV cache and the model's
weights, so an adapter costs its own tensors only. A step with k adapters in use reads the
weights k times: mixed traffic is served, at up to k times the cost of base-only traffic.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from typing import Any

from shoal.runtimes.base import SamplingParams
from shoal.runtimes.gguf_lora import gguf_adapter_path
from shoal.runtimes.model_files import resolve_source

# llama.cpp logs every load detail (and harmless warnings about this GGUF) to stderr;
# a worker keeps errors only.
_GGML_LOG_LEVEL_ERROR = 4


@dataclass(slots=True)
class _LlamaSequence:
    prompt: list[int]
    sampler: Any  # llama_sampler pointer
    prefilled: int = 0  # prompt tokens already in the KV cache
    next_token: int | None = None  # sampled, not yet fed back
    position: int = 0
    adapter: str | None = None  # the LoRA adapter it decodes with
    batch_index: int = field(default=-1)  # where its logits are in this step's batch


class LlamaCppRuntime:
    """A GGUF model on llama.cpp with batched decoding of up to `max_sequences` sequences.

    Options: max_sequences (16), context_length (tokens per sequence, 2048), batch_tokens
    (tokens decoded per step, shared by new prompts; 512), threads (the worker's setting, else
    all cores), gpu_layers (0; -1 offloads every layer to a GPU build).
    """

    simulated = False

    def __init__(self, name: str, source: str, options: dict[str, Any]) -> None:
        import llama_cpp

        self._lc = lc = llama_cpp
        self.name = name
        self.max_sequences = int(options.get("max_sequences", 16))
        self.batch_tokens = int(options.get("batch_tokens", 512))
        threads = int(options.get("threads") or 0) or os.cpu_count() or 1
        path = resolve_source(source, ".gguf")
        if path.is_dir():
            raise ValueError(f"llamacpp needs a .gguf file, got the directory {path}")
        self._log_callback = _quiet_logger(lc)
        lc.llama_log_set(self._log_callback, ctypes.c_void_p(0))
        lc.llama_backend_init()
        model_params = lc.llama_model_default_params()
        model_params.n_gpu_layers = int(options.get("gpu_layers", 0))
        self._model = lc.llama_model_load_from_file(str(path).encode(), model_params)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {path}")
        self._vocab = lc.llama_model_get_vocab(self._model)
        trained = lc.llama_model_n_ctx_train(self._model)
        self.context_length = min(int(options.get("context_length", 2048)), trained)
        context_params = lc.llama_context_default_params()
        context_params.n_ctx = self.context_length * self.max_sequences
        context_params.n_batch = self.batch_tokens
        context_params.n_ubatch = self.batch_tokens
        context_params.n_seq_max = self.max_sequences
        context_params.n_threads = threads
        context_params.n_threads_batch = threads
        context_params.kv_unified = True
        self._ctx = lc.llama_init_from_model(self._model, context_params)
        if not self._ctx:
            raise ValueError("llama.cpp could not create a context (out of memory?)")
        self._memory = lc.llama_get_memory(self._ctx)
        self._batch = lc.llama_batch_init(self.batch_tokens, 0, 1)
        self._add_bos = bool(lc.llama_vocab_get_add_bos(self._vocab))
        template = lc.llama_model_chat_template(self._model, None)
        self.chat_template = template.decode() if template else None
        self._sequences: dict[int, _LlamaSequence] = {}
        self._adapters: dict[str, Any] = {}  # name -> llama_adapter_lora pointer
        self._context_adapter: str | None = None  # the adapter set on the context now
        self._piece_buffer = ctypes.create_string_buffer(256)

    # -- text --------------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        capacity = len(data) + 8
        tokens = (self._lc.llama_token * capacity)()
        count = self._lc.llama_tokenize(
            self._vocab, data, len(data), tokens, capacity, self._add_bos, True
        )
        if count < 0:  # the buffer was too small: -count is the size needed
            capacity = -count
            tokens = (self._lc.llama_token * capacity)()
            count = self._lc.llama_tokenize(
                self._vocab, data, len(data), tokens, capacity, self._add_bos, True
            )
        return list(tokens[:count])

    def token_bytes(self, token: int) -> bytes:
        buffer = self._piece_buffer
        size = self._lc.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, False)
        if size < 0:
            buffer = ctypes.create_string_buffer(-size)
            size = self._lc.llama_token_to_piece(self._vocab, token, buffer, -size, 0, False)
        return buffer.raw[:size]

    def is_end_of_generation(self, token: int) -> bool:
        return bool(self._lc.llama_vocab_is_eog(self._vocab, token))

    # -- sequences ---------------------------------------------------------------------------

    def add_sequence(
        self, slot: int, prompt: list[int], sampling: SamplingParams, adapter: str | None = None
    ) -> None:
        if adapter is not None and adapter not in self._adapters:
            raise ValueError(f"no adapter {adapter} is loaded")
        if not 0 <= slot < self.max_sequences or slot in self._sequences:
            raise ValueError(f"slot {slot} is not free")
        if not prompt or len(prompt) >= self.context_length:
            raise ValueError(f"a prompt of {len(prompt)} tokens does not fit the context")
        self._lc.llama_memory_seq_rm(self._memory, slot, -1, -1)
        self._sequences[slot] = _LlamaSequence(
            prompt, self._make_sampler(sampling), adapter=adapter
        )

    def remove_sequence(self, slot: int) -> None:
        sequence = self._sequences.pop(slot, None)
        if sequence is not None:
            self._lc.llama_sampler_free(sequence.sampler)
            self._lc.llama_memory_seq_rm(self._memory, slot, -1, -1)

    def _make_sampler(self, sampling: SamplingParams):
        lc = self._lc
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        if sampling.temperature == 0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
            return chain
        if sampling.top_p < 1.0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_p(sampling.top_p, 1))
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(sampling.temperature))
        seed = lc.LLAMA_DEFAULT_SEED if sampling.seed is None else sampling.seed & 0xFFFFFFFF
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(seed))
        return chain

    # -- decoding ----------------------------------------------------------------------------

    def step(self) -> dict[int, int]:
        tokens: dict[int, int] = {}
        groups: dict[str | None, dict[int, _LlamaSequence]] = {}
        for slot, sequence in self._sequences.items():
            groups.setdefault(sequence.adapter, {})[slot] = sequence
        for adapter, sequences in groups.items():
            self._use_adapter(adapter)
            tokens.update(self._decode(sequences))
        return tokens

    def _decode(self, sequences: dict[int, _LlamaSequence]) -> dict[int, int]:
        """One llama_decode of these sequences: a token for each, or a prompt chunk."""
        batch = self._batch
        count = 0
        # Running sequences first: each needs one slot in the batch, and decoding them is
        # what keeps their tokens flowing while new prompts are processed in chunks.
        for slot, sequence in sequences.items():
            sequence.batch_index = -1
            if sequence.next_token is not None:
                self._put(batch, count, sequence.next_token, sequence.position, slot, True)
                sequence.batch_index = count
                sequence.position += 1
                count += 1
        for slot, sequence in sequences.items():
            left = len(sequence.prompt) - sequence.prefilled
            room = self.batch_tokens - count
            if sequence.next_token is not None or left == 0 or room <= 0:
                continue
            chunk = min(left, room)
            for i in range(chunk):
                last = sequence.prefilled + i == len(sequence.prompt) - 1
                token = sequence.prompt[sequence.prefilled + i]
                self._put(batch, count, token, sequence.position, slot, last)
                if last:
                    sequence.batch_index = count
                sequence.position += 1
                count += 1
            sequence.prefilled += chunk
        batch.n_tokens = count
        result = self._lc.llama_decode(self._ctx, batch)
        if result != 0:
            raise RuntimeError(f"llama_decode failed ({result}): the KV cache may be full")
        tokens: dict[int, int] = {}
        for slot, sequence in sequences.items():
            if sequence.batch_index >= 0:
                token = self._lc.llama_sampler_sample(
                    sequence.sampler, self._ctx, sequence.batch_index
                )
                sequence.next_token = token
                tokens[slot] = token
        return tokens

    # -- LoRA adapters ---------------------------------------------------------------------

    def add_adapter(self, name: str, path: str) -> None:
        """Load a LoRA adapter (a GGUF LoRA file, or a PEFT directory, converted once).

        The base model is not reloaded; the adapter's tensors are all it adds.
        """
        lc = self._lc
        layers = lc.llama_model_n_layer(self._model)
        gguf_path = gguf_adapter_path(path, self._architecture(), layers)
        adapter = lc.llama_adapter_lora_init(self._model, str(gguf_path).encode())
        if not adapter:
            raise ValueError(f"llama.cpp could not load {path} as a LoRA adapter of this model")
        old = self._adapters.get(name)
        self._adapters[name] = adapter
        if old is not None:
            if self._context_adapter == name:
                self._use_adapter(None)
            lc.llama_adapter_lora_free(old)

    def remove_adapter(self, name: str) -> None:
        """Free an adapter's tensors; sequences decoding with it must have ended first."""
        adapter = self._adapters.pop(name, None)
        if adapter is None:
            return
        if self._context_adapter == name:
            self._use_adapter(None)
        self._lc.llama_adapter_lora_free(adapter)

    def _use_adapter(self, name: str | None) -> None:
        """Set the context's adapter (None: the base) for the next decode."""
        if name == self._context_adapter:
            return
        lc = self._lc
        if name is None:
            result = lc.llama_set_adapters_lora(self._ctx, None, 0, None)
        else:
            adapters = (lc.llama_adapter_lora_p_ctypes * 1)(self._adapters[name])
            result = lc.llama_set_adapters_lora(self._ctx, adapters, 1, (ctypes.c_float * 1)(1.0))
        if result != 0:
            raise RuntimeError(f"llama.cpp could not set the adapter {name} ({result})")
        self._context_adapter = name

    def _architecture(self) -> str:
        buffer = ctypes.create_string_buffer(64)
        size = self._lc.llama_model_meta_val_str(
            self._model, b"general.architecture", buffer, len(buffer)
        )
        return buffer.value.decode() if size > 0 else ""

    @staticmethod
    def _put(batch, index: int, token: int, position: int, slot: int, logits: bool) -> None:
        batch.token[index] = token
        batch.pos[index] = position
        batch.n_seq_id[index] = 1
        batch.seq_id[index][0] = slot
        batch.logits[index] = logits

    def close(self) -> None:
        for slot in list(self._sequences):
            self.remove_sequence(slot)
        if self._batch is not None:
            self._lc.llama_batch_free(self._batch)
            self._batch = None
        self._adapters.clear()  # llama_model_free frees them
        if self._ctx:
            self._lc.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            self._lc.llama_model_free(self._model)
            self._model = None


def _quiet_logger(lc):
    @lc.llama_log_callback
    def log(level: int, text: bytes, user_data) -> None:
        if level == _GGML_LOG_LEVEL_ERROR:
            os.write(2, text)

    return log
