"""What each cluster fabric needs on a training pod (seed 004), as data.

Values follow the runtimes NVIDIA's AICR recipes ship for H100 clusters: GKE GPUDirect-TCPXO
(the tcpxo-daemon v1.0.21 sidecar paired with NCCL plugin v1.0.15), EKS EFA (aws-ofi-nccl)
and AKS InfiniBand. Nothing here talks to a cluster.
"""

from __future__ import annotations

from typing import Any, Literal

Fabric = Literal["none", "tcpxo", "efa", "ib"]
FABRICS: tuple[Fabric, ...] = ("none", "tcpxo", "efa", "ib")

GPU = "nvidia.com/gpu"
EFA = "vpc.amazonaws.com/efa"
RDMA = "rdma/hca_shared_devices_a"

# --- GKE GPUDirect-TCPXO -------------------------------------------------------------------
TCPXO_GPUS = 8  # a3-megagpu-8g: TCPXO needs all eight
TCPXO_NICS = 8
TCPXO_PLUGIN = "v1.0.15"  # the plugin the default daemon image below is paired with
TCPXO_DAEMON_IMAGE = (
    "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpxo/tcpgpudmarxd-dev:v1.0.21"
    "@sha256:8d9e10fd589a34ab8a0aa64f7e70ad075c8f1c69bea176350f8d211367697e3d"
)
# Google ships the NCCL plugin and the tcpxo-daemon as coupled pairs: a bump of one moves
# both. The plugin's version is the tag of its installer DaemonSet's image.
TCPXO_PAIRS = {"v1.0.15": "v1.0.21"}  # plugin -> daemon
TCPXO_INSTALLER_NAMESPACE = "kube-system"
# The installer's image path contains it (TCPX, A3 High's, is gpudirect-tcpx/: not this).
TCPXO_PLUGIN_IMAGE = "gpudirect-tcpxo/nccl-plugin-gpudirecttcpx"
TCPXO_PROFILE = "/usr/local/nvidia/lib64/nccl-env-profile.sh"
TCPXO_LIB_DIR = "/usr/local/nvidia/lib64"  # the profile builds its paths from NCCL_LIB_DIR
TCPXO_DEVICES = [f"/dev/nvidia{i}" for i in range(TCPXO_GPUS)] + [
    "/dev/nvidiactl",
    "/dev/nvidia-uvm",
    "/dev/dmabuf_import_helper",
]
TCPXO_HOST_PATHS = {  # volume name -> host path
    "nvtcpxo-libraries": "/home/kubernetes/bin/nvidia",
    "nvtcpxo-sys": "/sys",
    "nvtcpxo-proc-sys": "/proc/sys",
    "nvtcpxo-aperture-devices": "/dev/aperture_devices",
}
# Always set on the worker: where the mounted plugin lives and the aperture devices.
TCPXO_BASE_ENV = {
    "LD_LIBRARY_PATH": "/usr/lib/x86_64-linux-gnu:/usr/local/nvidia/lib64:/usr/local/cuda/lib64",
    "NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY": "/dev/aperture_devices",
}
# The NCCL configuration released with plugin v1.0.15 (inline form of the env profile).
TCPXO_NCCL_ENV = {
    "NCCL_FASTRAK_CTRL_DEV": "eth0",
    "NCCL_FASTRAK_IFNAME": ",".join(f"eth{i}" for i in range(1, TCPXO_NICS + 1)),
    "NCCL_SOCKET_IFNAME": "eth0",
    "NCCL_CROSS_NIC": "0",
    "NCCL_PROTO": "Simple,LL128",
    "NCCL_MIN_NCHANNELS": "4",
    "NCCL_TUNER_PLUGIN": "libnccl-tuner.so",
    "NCCL_TUNER_CONFIG_PATH": "/usr/local/nvidia/lib64/a3plus_tuner_config.textproto",
    "NCCL_SHIMNET_GUEST_CONFIG_CHECKER_CONFIG_FILE": (
        "/usr/local/nvidia/lib64/a3plus_guest_config.textproto"
    ),
    "NCCL_NVLSTREE_MAX_CHUNKSIZE": "131072",
    "NCCL_P2P_NET_CHUNKSIZE": "524288",
    "NCCL_P2P_PCI_CHUNKSIZE": "524288",
    "NCCL_P2P_NVL_CHUNKSIZE": "1048576",
    "NCCL_FASTRAK_NUM_FLOWS": "2",
    "NCCL_FASTRAK_USE_SNAP": "1",
    "NCCL_FASTRAK_PLUGIN_ACCEPT_TIMEOUT_MS": "600000",
    "NCCL_FASTRAK_ENABLE_CONTROL_CHANNEL": "0",
    "NCCL_BUFFSIZE": "8388608",
    "NCCL_NET_GDR_LEVEL": "PIX",
    "NCCL_FASTRAK_ENABLE_HOTPATH_LOGGING": "0",
    "NCCL_FASTRAK_USE_LLCM": "1",
    "NCCL_NVLS_ENABLE": "1",
}


def tcpxo_interfaces(networks: list[str]) -> str:
    """The networking.gke.io/interfaces value: eth0 on the default network, eth1..8 the NICs."""
    entries = [{"interfaceName": "eth0", "network": "default"}] + [
        {"interfaceName": f"eth{i}", "network": name} for i, name in enumerate(networks, 1)
    ]
    return (
        "["
        + ",".join(
            f'{{"interfaceName":"{e["interfaceName"]}","network":"{e["network"]}"}}'
            for e in entries
        )
        + "]"
    )


def tcpxo_daemon(image: str) -> dict[str, Any]:
    """The tcpxo-daemon native sidecar (an init container that keeps running)."""
    return {
        "name": "tcpxo-daemon",
        "image": image,
        "imagePullPolicy": "Always",
        "restartPolicy": "Always",  # a native sidecar; without it the pod stalls in init
        "command": ["/bin/sh", "-c"],
        "args": [
            "set -ex\nchmod 755 /fts/entrypoint_rxdm_container.sh\n"
            f"/fts/entrypoint_rxdm_container.sh --num_hops=2 --num_nics {TCPXO_NICS}\n"
        ],
        "securityContext": {"capabilities": {"add": ["NET_ADMIN", "NET_BIND_SERVICE"]}},
        "volumeMounts": [
            {"name": "nvtcpxo-libraries", "mountPath": "/usr/local/nvidia", "readOnly": True},
            {"name": "nvtcpxo-sys", "mountPath": "/hostsysfs"},
            {"name": "nvtcpxo-proc-sys", "mountPath": "/hostprocsysfs"},
        ],
        "env": [{"name": "LD_LIBRARY_PATH", "value": "/usr/local/nvidia/lib64"}],
    }


# --- EKS EFA -------------------------------------------------------------------------------
EFA_ENV = {
    "FI_EFA_FORK_SAFE": "1",
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "NCCL_SOCKET_IFNAME": "eth0",
    "NCCL_IGNORE_DISABLED_P2P": "1",
    "LD_LIBRARY_PATH": "/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu",
}

# --- AKS InfiniBand ------------------------------------------------------------------------
IB_ENV = {"NCCL_IB_DISABLE": "0", "NCCL_NET_PLUGIN": "none", "NCCL_SOCKET_IFNAME": "eth0"}

# Variables a fabric fixes: a user's different value is replaced, with a warning.
FIXED: dict[Fabric, set[str]] = {
    "none": set(),
    "tcpxo": {"NCCL_SOCKET_IFNAME", "NCCL_FASTRAK_IFNAME", "NCCL_FASTRAK_CTRL_DEV"},
    "efa": {"FI_EFA_FORK_SAFE", "FI_PROVIDER", "NCCL_SOCKET_IFNAME"},
    "ib": {"NCCL_IB_DISABLE", "NCCL_NET_PLUGIN", "NCCL_SOCKET_IFNAME"},
}

# What NCCL names the network it attached to, per fabric.
# aws-ofi-nccl calls itself "AWS Libfabric" up to 1.11, "Libfabric" after (or "OFI" when
# NCCL_NET=OFI asks for it by that name).
BANNER: dict[Fabric, tuple[str, ...]] = {
    "tcpxo": ("FasTrak",),
    "efa": ("AWS Libfabric", "Libfabric", "OFI"),
    "ib": ("IB",),
}

IPC_LOCK = {"capabilities": {"add": ["IPC_LOCK"]}}
DSHM_VOLUME = {"name": "dshm", "emptyDir": {"medium": "Memory"}}
DSHM_MOUNT = {"name": "dshm", "mountPath": "/dev/shm"}


def image_tag(image: str) -> str | None:
    """The tag of an image reference (``registry/name:v1.0.21@sha256:...`` -> v1.0.21)."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return last.split(":", 1)[1] if ":" in last else None
