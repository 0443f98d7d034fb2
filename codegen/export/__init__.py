"""The `export` command: its options (`options`, `command.ExportOptions`), the graphs an export
writes and the folder it writes (`command`), QAIC's files (`qaic`), the embedded default model
(`defaults`). Imports `check`, `graphs`, `lower`, `folder`; never `cli`."""
