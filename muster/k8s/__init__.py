"""Kubeflow Trainer render / apply / preflight / verify-fabric (seed 004)."""
