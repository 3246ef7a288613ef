"""``offload-zero train``: train or fine-tune a causal LM with :class:`OffloadEngine`.

The model is either a Llama-style causal LM built from ``transformers.LlamaConfig`` (size from
a named preset, optionally overridden per field) with the byte tokenizer of
:mod:`offload_zero.data`, or a local Hugging Face checkpoint (``--model DIR``) with its own
tokenizer. Text comes from ``--data`` files/directories, or by default from the Python standard
library's sources. The run ends with a summary (losses, peak bytes per tier, NVMe traffic,
time, throughput) printed to stdout and optionally written as JSON. ``--save DIR`` keeps the
trained weights as ``DIR/model.safetensors`` (with the Hugging Face config, generation config
and tokenizer), a folder that ``--model DIR`` and
``transformers.AutoModelForCausalLM.from_pretrained`` load.

:func:`add_arguments` fills the ``train`` sub-parser; :func:`run` executes a parsed namespace
and returns the summary. Bad user input raises ``ValueError`` (the CLI turns it into a
one-line message and exit status 2).

Modules: :mod:`~offload_zero.train.arguments` (the flags, their checks, ``--deepspeed``),
:mod:`~offload_zero.train.model` (presets, ``--model DIR``), :mod:`~offload_zero.train.loop`
(:func:`run` and the optimizer steps), :mod:`~offload_zero.train.resume` (``--checkpoint``,
``--resume``), :mod:`~offload_zero.train.hf_folder` (``--save``), :mod:`~offload_zero.train.disk`
(the NVMe swap folder) and :mod:`~offload_zero.train.summary`.
"""
from offload_zero import data as data_lib  # noqa: F401
from offload_zero.train.arguments import (DEFAULTS, DESCRIPTION, DTYPES,  # noqa: F401
                                          add_arguments, apply_deepspeed_config, check_args,
                                          explicit_flags)
from offload_zero.train.disk import check_disk_space, nvme_bytes_needed  # noqa: F401
from offload_zero.train.hf_folder import (WEIGHTS_NAME, check_save_dir, export,  # noqa: F401
                                          save_generation_config, save_hf_folder,
                                          tied_weight_patterns, unshare_tensors)
from offload_zero.train.loop import lr_at, run  # noqa: F401
from offload_zero.train.model import (DEFAULT_PRESET, PRESETS, ModelSize,  # noqa: F401
                                      build_model, model_source, resolve_size)
from offload_zero.train.resume import (check_checkpoint_args, data_fingerprint,  # noqa: F401
                                       read_resume_state, resumed_step, save_training_state)
from offload_zero.train.summary import (format_summary, peak_rss_bytes,  # noqa: F401
                                        plot_memory, summarize)
