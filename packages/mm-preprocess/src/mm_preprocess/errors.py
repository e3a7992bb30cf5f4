"""Errors raised by mm_preprocess. Each names what failed so an agent loop can log and move on."""

from __future__ import annotations

__all__ = ["PreprocessorClosed", "VisionDecodeError"]


class VisionDecodeError(ValueError):
    """An image or video in a conversation could not be turned into model input.

    Raised for missing or empty files, truncated or non-image bytes, decompression bombs,
    unsupported or disabled URL schemes, remote timeouts, and inputs qwen-vl-utils rejects
    (e.g. an aspect ratio above 200).

    Attributes:
        message_index: index of the message (in its conversation) that holds the bad input.
        source: a short, printable description of the input (path, URL, or a placeholder for
            data URIs, bytes and PIL images; never the whole payload).
        reason: what went wrong, in words.
        content_index: index of the element inside the message's `content` list.
        conversation_index: index of the conversation when a list of conversations was given.
    """

    def __init__(
        self,
        *,
        message_index: int,
        source: str,
        reason: str,
        content_index: int | None = None,
        conversation_index: int | None = None,
    ) -> None:
        self.message_index = message_index
        self.source = source
        self.reason = reason
        self.content_index = content_index
        self.conversation_index = conversation_index
        super().__init__(self._describe())

    def _describe(self) -> str:
        where = f"message {self.message_index}"
        if self.content_index is not None:
            where += f", content {self.content_index}"
        if self.conversation_index is not None:
            where = f"conversation {self.conversation_index}, {where}"
        return f"cannot decode vision input in {where} ({self.source}): {self.reason}"

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only __init__: make the error picklable (Ray, multiprocessing).
        return (_rebuild_decode_error, (self.__dict__.copy(),))


def _rebuild_decode_error(state: dict[str, object]) -> VisionDecodeError:
    return VisionDecodeError(
        message_index=int(state["message_index"]),  # type: ignore[call-overload]
        source=str(state["source"]),
        reason=str(state["reason"]),
        content_index=state.get("content_index"),  # type: ignore[arg-type]
        conversation_index=state.get("conversation_index"),  # type: ignore[arg-type]
    )


class PreprocessorClosed(RuntimeError):
    """The VisionPreprocessor was closed: the job was refused or dropped before it started."""
