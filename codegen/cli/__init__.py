"""The command line: its grammar (`parser`) and value readers (`arguments`); `codegen.__main__`
dispatches. Nothing imports it."""
