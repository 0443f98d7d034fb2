"""An export folder opened once (`open_folder`): its manifest (shards checked once), its
checkpoint (the target and an MTP assistant's drafter: `paired.open_export`) and each graph's
ModelProto loaded on first use, passed down to every reader of one command (`verify`, its
`--write-npi` and `--prompts` calibration, `drift --plans`, `run`, `serve`) instead of each
reopening the folder: `verify --write-npi --prompts` read the manifest twice and checked the
shards twice."""

import dataclasses
import os

from codegen.folder import paired
from codegen.folder.sessions import load_graph, open_session, read_manifest


@dataclasses.dataclass
class Export:
    """An opened export folder: `folder` (absolute), `manifest` (a `manifest.Manifest`),
    `checkpoint` (`paired.open_export`), and the graphs loaded so far by name."""

    folder: str
    manifest: object
    checkpoint: object
    models: dict = dataclasses.field(default_factory=dict)

    def graph(self, entry):
        """The ModelProto of manifest `entry` (`sessions.load_graph`: external data left on
        disk), loaded once."""
        if entry.name not in self.models:
            self.models[entry.name] = load_graph(entry, self.folder, self.checkpoint)
        return self.models[entry.name]

    def session(self, entry):
        """A new onnxruntime session on manifest `entry`'s graph (`sessions.open_session`)."""
        return open_session(entry, self.folder, self.checkpoint)


def open_folder(folder, *, check_shards=True):
    """`folder` opened (`Export`; its shards checked against the manifest unless told not
    to), or `folder` itself when it is an `Export` already (opened once, checked then)."""
    if isinstance(folder, Export):
        return folder
    folder = os.path.abspath(folder)
    manifest = read_manifest(folder, check_shards=check_shards)
    return Export(folder, manifest, paired.open_export(folder))
