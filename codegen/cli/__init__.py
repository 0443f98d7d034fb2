"""The command line: its grammar (`parser`, each command's arguments in `export_args`,
`run_args`, `check_args`, `kit_args`) and value readers (`arguments`); `codegen.__main__`
dispatches. Nothing imports it."""
