"""Threaded, bounded vision preprocessing (qwen-vl-utils) that never blocks an event loop.

`import mm_preprocess` is light: qwen-vl-utils, torch and transformers are imported on first
use, inside the worker threads.
"""

from mm_preprocess.config import VisionConfig
from mm_preprocess.errors import PreprocessorClosed, VisionDecodeError
from mm_preprocess.lag_monitor import EventLoopLagMonitor, LagSnapshot
from mm_preprocess.pipeline import process_multi_modal_info_sync, process_vision_info_sync
from mm_preprocess.preprocessor import PreprocessorStats, VisionPreprocessor
from mm_preprocess.results import ItemResult, MultiModalInfo, VisionInputs

__all__ = [
    "EventLoopLagMonitor",
    "ItemResult",
    "LagSnapshot",
    "MultiModalInfo",
    "PreprocessorClosed",
    "PreprocessorStats",
    "VisionConfig",
    "VisionDecodeError",
    "VisionInputs",
    "VisionPreprocessor",
    "process_multi_modal_info_sync",
    "process_vision_info_sync",
]
