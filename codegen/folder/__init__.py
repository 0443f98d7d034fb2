"""The export folder's contract, read by every command: manifest.json (`manifest`, plain
Python), the graphs' pointers into the checkpoint's bytes (`external`), shard hashes
(`integrity`, `hashcache`), opening graphs and sessions and publishing a folder (`sessions`).
Imports no other codegen package."""
