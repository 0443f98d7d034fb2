"""The kernel author's kit: golden vectors (`vectors`, `vector_cases`, `vector_options`: one
table of ops and modes) and schedules with their costs and pictures (`schedule`,
`moe_schedule`, `draw`). `ref` and numpy only: no ONNX library, no other codegen package."""
