"""Refresh tests/k8s/crds from ../shared/data/kubeflow: each CRD's openAPIV3Schema, gzipped JSON.

    .venv/bin/python tests/k8s/vendor_crds.py [PATH_TO_DATA_KUBEFLOW]

The CRDs are Kubeflow Trainer's (Apache-2.0), releases v2.3.0 and v2.2.0; see crds/SOURCE.txt.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).parent / "crds"
KINDS = {
    "TrainJob": "trainer.kubeflow.org_trainjobs.yaml",
    "TrainingRuntime": "trainer.kubeflow.org_trainingruntimes.yaml",
    "ClusterTrainingRuntime": "trainer.kubeflow.org_clustertrainingruntimes.yaml",
}
RELEASES = {"2.3": "", "2.2": "v2.2.0/"}


def main() -> None:
    default = Path(__file__).resolve().parents[3] / "shared/data/kubeflow"
    source = Path(sys.argv[1]) if len(sys.argv) > 1 else default
    for release, sub in RELEASES.items():
        for kind, name in KINDS.items():
            crd = yaml.safe_load((source / sub / name).read_text())
            (version,) = crd["spec"]["versions"]
            schema = version["schema"]["openAPIV3Schema"]
            out = HERE / f"{kind}-{release}.json.gz"
            out.write_bytes(gzip.compress(json.dumps(schema, sort_keys=True).encode(), mtime=0))
            print(f"{out.name}: {out.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
