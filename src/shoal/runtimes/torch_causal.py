"""`torch` for generation: causal language models on PyTorch (transformers), decoded in batches.

A source is a Hugging Face model directory or a `.gguf` file (a path, or `package:NAME` as for
every runtime). transformers reads a GGUF file by dequantizing it, which takes tens of seconds
for Gemma 3 270M, so the first load converts it once into the cache directory
(`<cache>/models/<file stem>-hf`, safetensors) and every later start loads that.

Batching. Every slot owns one row of a preallocated key/value cache (`SlotKVCache`): the token
at position p of the sequence in that row is stored in column p. One `step()`:

1. runs the prompt of each newly added sequence (one forward pass each, prompt in one piece),
   which gives its first token;
2. decodes every other running sequence together: one forward pass of one token per row, each
   row at its own position, with an explicit attention mask that lets a row see only its own
   columns (and only the last `sliding_window` of them in sliding-window layers).

Rows are kept packed at the front of the cache (a removed sequence's row is refilled by moving
the last row into it), so a step reads a view of the cache, never a gathered copy.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.runtimes.base import SamplingParams
from shoal.runtimes.model_files import cache_dir, resolve_source, write_once
from shoal.runtimes.torch_setup import import_torch

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@dataclass(slots=True)
class _TorchSequence:
    slot: int
    prompt: list[int]
    sampling: SamplingParams
    generator: Any  # torch.Generator, for sampled (temperature > 0) decoding
    adapter: str | None = None  # the LoRA adapter it decodes with
    position: int = 0  # tokens of this sequence in the cache
    next_token: int | None = None  # sampled, not yet fed back


class SlotKVCache:
    """Keys and values for `rows` sequences, one row each, column = position in the sequence.

    It implements the one method transformers' attention layers call on a cache (`update`):
    the new keys and values go to the columns `columns` of rows [first, end), and the layer
    attends over the first `width` columns of those rows, with the mask the runtime passes.
    """

    def __init__(self, config: Any, rows: int, length: int, dtype: Any) -> None:
        import torch

        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        shape = (rows, kv_heads, length, head_dim)
        layers = config.num_hidden_layers
        self.keys = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
        self.first = 0  # this forward pass works on rows [first, end)
        self.end = 0
        self.columns: Any = None  # [rows, new tokens]: where each new key goes
        self.width = 0  # columns the attention reads

    def prepare(self, first: int, rows: int, columns: Any, width: int) -> None:
        self.first, self.end, self.columns, self.width = first, first + rows, columns, width

    def update(self, key_states, value_states, layer_idx: int, *args: Any, **kwargs: Any):
        import torch

        rows = torch.arange(self.first, self.end).unsqueeze(1)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        # [rows, heads, new, dim] -> [rows, new, heads, dim], the layout the index expects
        keys[rows, :, self.columns] = key_states.transpose(1, 2)
        values[rows, :, self.columns] = value_states.transpose(1, 2)
        span = slice(self.first, self.end)
        return keys[span, :, : self.width], values[span, :, : self.width]

    def move_row(self, source: int, target: int, columns: int) -> None:
        for tensor in (*self.keys, *self.values):
            tensor[target, :, :columns] = tensor[source, :, :columns]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width


class TorchCausalRuntime:
    """A causal LM on transformers with batched decoding of up to `max_sequences` sequences.

    Options: max_sequences (8), context_length (tokens per sequence, 1024), threads
    ($SHOAL_THREADS, else torch's default), dtype (float32; bfloat16 halves memory), device
    (cuda when available, else cpu).
    """

    simulated = False

    def __init__(self, name: str, source: str, options: dict[str, Any]) -> None:
        torch, self.device = import_torch(options)

        self._torch = torch
        self.name = name
        self.max_sequences = int(options.get("max_sequences", 8))
        dtype = getattr(torch, str(options.get("dtype", "float32")))
        self.model, self.tokenizer = load_causal_lm(resolve_source(source, ".gguf"), dtype)
        self.model.to(self.device).eval()
        config = self.model.config
        limit = getattr(config, "max_position_embeddings", None) or 2048
        self.context_length = min(int(options.get("context_length", 1024)), limit)
        self.chat_template = getattr(self.tokenizer, "chat_template", None) or None
        self._layer_types = list(getattr(config, "layer_types", None) or [])
        self._window = getattr(config, "sliding_window", None)
        self._cache = SlotKVCache(config, self.max_sequences, self.context_length, dtype)
        if self.device != "cpu":
            self._cache.keys = [t.to(self.device) for t in self._cache.keys]
            self._cache.values = [t.to(self.device) for t in self._cache.values]
        self._rows: list[_TorchSequence] = []  # row i holds self._rows[i]
        self._end_ids = _end_of_generation_ids(self.tokenizer, self.model)
        self._special_ids = set(self.tokenizer.all_special_ids)
        self._byte_level = _is_byte_level(self.tokenizer)
        self._byte_decoder = _bytes_to_unicode_inverse() if self._byte_level else {}
        self._piece_bytes: dict[int, bytes] = {}
        self._peft = None  # the model wrapped by peft once an adapter is added
        self._adapters: set[str] = set()

    # -- text --------------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def token_bytes(self, token: int) -> bytes:
        cached = self._piece_bytes.get(token)
        if cached is None:
            cached = self._piece_bytes[token] = self._decode_piece(token)
        return cached

    def _decode_piece(self, token: int) -> bytes:
        if token in self._special_ids:
            return b""  # control tokens add no text, as llama.cpp renders them
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if piece is None:
            return b""
        byte = _BYTE_PIECE.match(piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        if self._byte_level:
            return bytes(self._byte_decoder.get(ch, 0) for ch in piece)
        return piece.replace("\u2581", " ").encode()  # SentencePiece's word boundary

    def is_end_of_generation(self, token: int) -> bool:
        return token in self._end_ids

    # -- sequences ---------------------------------------------------------------------------

    def add_sequence(
        self, slot: int, prompt: list[int], sampling: SamplingParams, adapter: str | None = None
    ) -> None:
        if not 0 <= slot < self.max_sequences or any(s.slot == slot for s in self._rows):
            raise ValueError(f"slot {slot} is not free")
        if adapter is not None and adapter not in self._adapters:
            raise ValueError(f"no adapter {adapter} is loaded")
        if not prompt or len(prompt) >= self.context_length:
            raise ValueError(f"a prompt of {len(prompt)} tokens does not fit the context")
        generator = None
        if sampling.temperature > 0:
            generator = self._torch.Generator(device=self.device)
            if sampling.seed is None:
                generator.seed()
            else:
                generator.manual_seed(sampling.seed & 0xFFFFFFFFFFFFFFFF)
        self._rows.append(_TorchSequence(slot, prompt, sampling, generator, adapter))

    def remove_sequence(self, slot: int) -> None:
        row = next((i for i, s in enumerate(self._rows) if s.slot == slot), None)
        if row is None:
            return
        # Keep rows packed, running sequences first and new ones (nothing cached yet) after:
        # the last running row fills a running hole, and the last row fills what is left.
        running = sum(1 for s in self._rows if s.next_token is not None)
        hole = row
        if row < running - 1:
            self._cache.move_row(running - 1, row, self._rows[running - 1].position)
            self._rows[row] = self._rows[running - 1]
            hole = running - 1
        self._rows[hole] = self._rows[-1]
        self._rows.pop()

    # -- decoding ----------------------------------------------------------------------------

    def step(self) -> dict[int, int]:
        torch = self._torch
        tokens: dict[int, int] = {}
        with torch.inference_mode():
            decoding = [i for i, s in enumerate(self._rows) if s.next_token is not None]
            if decoding:
                tokens.update(self._decode(len(decoding)))
            for row, sequence in enumerate(self._rows):
                if sequence.next_token is None:
                    tokens[sequence.slot] = self._prefill(row, sequence)
        return tokens

    def _decode(self, count: int) -> dict[int, int]:
        # Running sequences are the first `count` rows (see remove_sequence).
        torch = self._torch
        sequences = self._rows[:count]
        positions = torch.tensor([[s.position] for s in sequences])
        width = int(positions.max()) + 1
        ids = torch.tensor([[s.next_token] for s in sequences], device=self.device)
        with self._adapters_for([s.adapter for s in sequences]):
            logits = self._forward(ids, positions, width)
        result = {}
        for row, sequence in enumerate(sequences):
            sequence.position += 1
            token = self._sample(logits[row], sequence)
            sequence.next_token = token
            result[sequence.slot] = token
        return result

    def _prefill(self, row: int, sequence: _TorchSequence) -> int:
        torch = self._torch
        length = len(sequence.prompt)
        ids = torch.tensor([sequence.prompt], device=self.device)
        positions = torch.arange(length).unsqueeze(0)
        with self._adapters_for([sequence.adapter]):
            logits = self._forward(ids, positions, length, first_row=row)
        sequence.position = length
        token = self._sample(logits[0], sequence)
        sequence.next_token = token
        return token

    def _forward(self, ids, positions, width: int, first_row: int = 0):
        """Logits of the last new token of rows first_row .. first_row + len(ids) - 1."""
        torch = self._torch
        rows, new = ids.shape
        self._cache.prepare(first_row, rows, positions, width)
        columns = torch.arange(width)
        # Row r's new token at position p sees columns 0..p of its own row: causal masking
        # inside the prompt, and nothing of the stale columns past its length.
        visible = columns.view(1, 1, width) <= positions.view(rows, new, 1)
        masks: Any = visible.unsqueeze(1).to(self.device)
        if self._layer_types:
            masks = {kind: masks for kind in set(self._layer_types)}
            if self._window and "sliding_attention" in masks:
                recent = columns.view(1, 1, width) > positions.view(rows, new, 1) - self._window
                masks["sliding_attention"] = (visible & recent).unsqueeze(1).to(self.device)
        output = self.model(
            input_ids=ids,
            position_ids=positions.to(self.device),
            attention_mask=masks,
            cache=self._cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return output.logits[:, -1, :].float()

    def _sample(self, logits, sequence: _TorchSequence) -> int:
        torch = self._torch
        sampling = sequence.sampling
        if sampling.temperature == 0:
            return int(torch.argmax(logits))
        probabilities = torch.softmax(logits / sampling.temperature, dim=-1)
        if sampling.top_p < 1.0:
            ordered, order = torch.sort(probabilities, descending=True)
            before = torch.cumsum(ordered, dim=-1) - ordered
            ordered[before >= sampling.top_p] = 0.0  # keep the smallest set reaching top_p
            probabilities = torch.zeros_like(probabilities).scatter(0, order, ordered)
        choice = torch.multinomial(probabilities, 1, generator=sequence.generator)
        return int(choice)

    # -- LoRA adapters ---------------------------------------------------------------------

    def add_adapter(self, name: str, path: str) -> None:
        """Load a PEFT LoRA adapter beside the base weights (the base is not reloaded)."""
        from peft import PeftModel

        if name in self._adapters:
            self._peft.delete_adapter(name)
            self._adapters.discard(name)
        if self._peft is None:
            # peft puts its LoRA layers into self.model in place; calls go on to self.model.
            self._peft = PeftModel.from_pretrained(self.model, path, adapter_name=name)
        else:
            self._peft.load_adapter(path, adapter_name=name)
        self._peft.eval()
        self._adapters.add(name)

    def remove_adapter(self, name: str) -> None:
        """Drop an adapter's weights; sequences decoding with it must have ended first."""
        if self._peft is not None and name in self._adapters:
            self._peft.delete_adapter(name)
            self._adapters.discard(name)

    def _adapters_for(self, names: list[str | None]):
        """A context in which row i of the next forward pass decodes with adapter names[i]."""
        if self._peft is None:
            return contextlib.nullcontext()
        if not any(names):
            return self._peft.disable_adapter()
        # The same per-row adapter hooks as PeftModel.forward(adapter_names=...): rows of
        # different adapters (and "__base__") share one forward pass.
        rows = [n if n is not None else "__base__" for n in names]
        return self._peft._enable_peft_forward_hooks(adapter_names=rows)

    def close(self) -> None:
        self._rows.clear()
        del self.model
        self._cache = None  # type: ignore[assignment]


def load_causal_lm(path: Path, dtype: Any) -> tuple[Any, Any]:
    """Model and tokenizer from a model directory, or from a GGUF file (converted once)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = path if path.is_dir() else converted_gguf_dir(path)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype)
    return model, tokenizer


def converted_gguf_dir(gguf: Path) -> Path:
    """A transformers directory holding the dequantized GGUF model; made on first use."""
    if gguf.suffix != ".gguf":
        raise ValueError(f"torch generation needs a model directory or a .gguf file, got {gguf}")
    target = cache_dir() / "models" / f"{gguf.stem}-{gguf.stat().st_size}-hf"
    if target.exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are dequantized already: save them as a plain model, not as "GGUF".
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    def save(path: Path) -> None:
        model.save_pretrained(str(path))
        tokenizer.save_pretrained(str(path))

    write_once(target, save)
    return target


def _end_of_generation_ids(tokenizer: Any, model: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    # Chat-tuned models end a turn with their own token (Gemma's <end_of_turn>, ChatML's
    # <|im_end|>), as llama.cpp's end-of-generation list does.
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in ("<end_of_turn>", "<|im_end|>", "<|eot_id|>") if t in vocab)
    return frozenset(ids)


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None) if backend is not None else None
    return decoder is not None and "ByteLevel" in type(decoder).__name__ + repr(decoder)


def _bytes_to_unicode_inverse() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character that stands for each byte, inverted."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    characters = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, characters, strict=True)}
