"""Checking an export: structure at export time (`structure`), onnxruntime against `ref` whole
or layer by layer (`verify`, `layerwise`, `segments`, `head_slices`), the device's precision
(`device_graph`, `precision`, `layered_precision`, `npi`) and greedy drift (`drift`,
`plan_drift`). Imports `run`, `folder`, `graphs`, `lower`; never `export` or `cli`."""
