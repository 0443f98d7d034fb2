"""The export's default option values, in one home: `codegen.export.command.ExportOptions`
takes them as its field defaults and `codegen.cli.export_args` quotes them in `--help` (the command
line leaves an option it is not given to ExportOptions); and ExportError, what a bad option
raises. No imports: the command line reads it cheaply."""

EXPORT_DEFAULTS = {
    "batch_size": 1,
    "seq_len": 128,
    "ctx_len": 256,
    "num_cores": 16,
    "num_devices": 1,
    "hw_version": "ai100",
    # the audio graph (`codegen.graphs.audio`, exported when the checkpoint has an audio tower):
    # soft tokens per call (4 log-mel frames each, 40 ms: ≈ 7.5 s and 30 s), clips per call
    "audio_budgets": (188, 750),
    "audio_clips": 4,
}


class ExportError(ValueError):
    """Bad options or an output folder that cannot be written."""
