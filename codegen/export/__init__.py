"""The `export` command: its defaults and error (`options`), its options and the run that
writes the folder (`command`), the graphs an export writes (`specs`), each graph's files
(`graph_files`), QAIC's files (`qaic`), the embedded default model (`defaults`). Imports
`check`, `graphs`, `lower`, `folder`; never `cli`."""
