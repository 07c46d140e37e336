"""Launcher discovery (hpccomm.launcher) and the launch checks at init.

Plain pytest.  Unit tests read recorded environments, one per launcher:
  - RECORDED here: Open MPI 5.0.11 ``mpirun -n 2`` (the venv's wheel), MPICH
    5.0.2 Hydra ``mpiexec -n 2`` (the ``mpich`` wheel), Intel MPI 2021.18.1
    ``mpiexec -n 2`` and ``mpirun -n 2`` (the ``impi-rt`` wheel), torchrun of
    torch 2.13.0 (``python -m torch.distributed.run --nproc-per-node 2``): the
    launcher-set variables of rank 1, verbatim; and ``srun --mpi=pmi2`` with
    the MPICH wheel on the two-node test SLURM (tests/slurm/cluster.sh).
  - WRITTEN FROM DOCUMENTATION, not recorded: srun without a plugin and with
    --mpi=pmix (SLURM's srun(1) "OUTPUT ENVIRONMENT VARIABLES" and its mpi/pmix
    plugin's variables), and the nested launches (mpirun, mpiexec or torchrun
    started inside a SLURM step).
Then real launches of the launchers that run here: the launcher of the MPI
family in use (tests/mpilaunch.py: Open MPI's mpirun, MPICH's mpiexec or
Intel MPI's mpirun), torchrun, and a plain process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import asdict
from pathlib import Path

import pytest
from mpilaunch import require

import hpccomm
from hpccomm import launcher
from hpccomm._start import bootstrap
from hpccomm.launcher import Launch

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 120

OPEN_MPI_LIBRARY = ("Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11, repo rev: "
                    "v5.0.11rc1, Sep 16, 2026")  # MPI_Get_library_version, first line, recorded here
MPICH_LIBRARY = "MPICH Version:      5.0.2"       # recorded here (the mpich wheel)
INTEL_LIBRARY = "Intel(R) MPI Library 2021.18.1 for Linux* OS"  # recorded here (the impi-rt wheel)

# --------------------------------------------------------------------------
# environments
# --------------------------------------------------------------------------

#: RECORDED: rank 1 of ``mpirun -n 2 --oversubscribe python dump.py`` (Open MPI 5.0.11 wheel).
OPEN_MPI = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_ARGV": "dump.py",
    "OMPI_COMMAND": "python", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_NODE_RANK": "1", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_FILE_LOCATION": "/tmp/ompi.20677/1/1", "OMPI_LIBDIR_LOC": "/work/venv/lib",
    "OMPI_MCA_PREFIXES": "mca,opal,ompi,atomic,memheap,scoll,spml,sshmem,bml,coll,fbtl,fcoll,fs,hook,io,mtl,op,"
                         "osc,part,pml,sharedfp,topo,vprotocol,accelerator,allocator,backtrace,btl,dl,hwloc,if,"
                         "installdirs,memchecker,memcpy,memory,mpool,patcher,rcache,reachable,shmem,smsc,threads,"
                         "timer",
    "OMPI_MCA_cpu_type": "x86_64", "OMPI_MCA_initial_wdir": "/tmp/i6rec", "OMPI_MCA_mpi_yield_when_idle": "1",
    "OMPI_MCA_num_procs": "2", "OMPI_NUM_APP_CTX": "1", "OMPI_TOOL_NAME": "mpirun", "OMPI_UNIVERSE_SIZE": "2",
    "OMPI_VERSION": "5.0.11", "OMPI_WORLD_LOCAL_SIZE": "2", "OMPI_WORLD_SIZE": "2",
    "PMIX_BFROP_BUFFER_TYPE": "PMIX_BFROP_BUFFER_NON_DESC", "PMIX_GDS_MODULE": "shmem2,hash", "PMIX_HOSTNAME": "vm",
    "PMIX_NAMESPACE": "prterun-vm-20677@1", "PMIX_PARAM_FILE_PASSED": "1", "PMIX_PREFIX": "/work/venv",
    "PMIX_RANK": "1", "PMIX_SECURITY_MODE": "native", "PMIX_SERVER_TMPDIR": "/tmp/ompi.20677",
    "PMIX_SERVER_URI2": "prterun-vm-20677@0.0;tcp4://127.0.0.1:55989",
    "PMIX_SERVER_URI21": "prterun-vm-20677@0.0;tcp4://127.0.0.1:55989",
    "PMIX_SERVER_URI3": "prterun-vm-20677@0.0;tcp4://127.0.0.1:55989",
    "PMIX_SERVER_URI4": "prterun-vm-20677@0.0;tcp4://127.0.0.1:55989",
    "PMIX_SERVER_URI41": "prterun-vm-20677@0.0;tcp4://127.0.0.1:55989",
    "PMIX_SYSTEM_TMPDIR": "/tmp", "PMIX_VERSION": "5.0.11rc1", "PRTE_LAUNCHED": "1", "PRTE_SHARED_FS": "FALSE",
}

#: RECORDED: rank 1 of ``env -i PATH=... mpiexec -n 2 /usr/bin/env`` (MPICH 5.0.2 wheel, Hydra).
MPICH = {
    "GFORTRAN_UNBUFFERED_PRECONNECTED": "y", "HYDI_CONTROL_FD": "7", "MPI_LOCALNRANKS": "2", "MPI_LOCALRANKID": "1",
    "PMI_FD": "9", "PMI_HOSTNAME": "vm", "PMI_RANK": "1", "PMI_SIZE": "2",
}

#: RECORDED: rank 1 of ``python -m torch.distributed.run --nproc-per-node 2 dump.py`` (torch 2.13.0).
TORCHRUN = {
    "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "localhost", "MASTER_PORT": "35755", "OMP_NUM_THREADS": "1", "RANK": "1", "ROLE_NAME": "default",
    "ROLE_RANK": "1", "ROLE_WORLD_SIZE": "2",
    "TORCHELASTIC_ERROR_FILE": "/tmp/torchelastic_z6ttizlf/8502fdc0-5aae-436d-91c8-1e072cfd55f4__qrb6yvc/attempt_0/"
                               "1/error.json",
    "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_RUN_ID": "8502fdc0-5aae-436d-91c8-1e072cfd55f4",
    "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT", "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "WORLD_SIZE": "2",
}

#: RECORDED: rank 1 of ``env -i PATH=... mpiexec -n 2 /usr/bin/env`` (Intel MPI 2021.18.1, the impi-rt wheel):
#: Hydra's PMI_* and MPI_LOCAL* as MPICH's, no HYDI_CONTROL_FD, and Intel's own I_MPI_*/HYDRA_BSTRAP_*.
INTEL_MPI = {
    "GFORTRAN_UNBUFFERED_PRECONNECTED": "y", "HYDRA_BSTRAP_DEBUG": "0", "HYDRA_BSTRAP_DOWNSTREAM_CONTROL": "",
    "HYDRA_BSTRAP_DOWNSTREAM_HOSTS": "", "HYDRA_BSTRAP_DOWNSTREAM_PID": "", "HYDRA_BSTRAP_DOWNSTREAM_STDERR": "",
    "HYDRA_BSTRAP_DOWNSTREAM_STDOUT": "", "HYDRA_BSTRAP_LAUNCHER": "ssh", "HYDRA_BSTRAP_LOCALHOST": "vm",
    "HYDRA_BSTRAP_NODE_ID": "0", "HYDRA_BSTRAP_NUM_DOWNSTREAM_PROXIES": "0", "HYDRA_BSTRAP_NUM_LAUNCHES": "-1",
    "HYDRA_BSTRAP_PGID": "0", "HYDRA_BSTRAP_PROXY_ID": "0", "HYDRA_BSTRAP_SUBTREE_SIZE": "1",
    "HYDRA_BSTRAP_TREE_WIDTH": "16", "HYDRA_BSTRAP_UPSTREAM_FD": "7", "HYDRA_IP_VERSION": "2",
    "HYDRA_LAUNCH_TYPE": "2", "I_MPI_BIND_WIN_ALLOCATE": "localalloc", "I_MPI_HYDRA_TOPOLIB": "ipl2",
    "I_MPI_HYDRA_UUID": "b02d0000-9855-e403-ea60-0600866b6b7d", "I_MPI_INFO_BRAND": "AMD EPYC",
    "I_MPI_INFO_CACHE1": "0,1", "I_MPI_INFO_CACHE2": "0,1", "I_MPI_INFO_CACHE3": "0,0", "I_MPI_INFO_CACHES": "3",
    "I_MPI_INFO_CACHE_SHARE": "0,0,0", "I_MPI_INFO_CACHE_SIZE": "0,0,0", "I_MPI_INFO_CORE": "0,1",
    "I_MPI_INFO_C_NAME": "Unknown", "I_MPI_INFO_DESC": "0", "I_MPI_INFO_FLGB": "-239138901",
    "I_MPI_INFO_FLGC": "-380413", "I_MPI_INFO_FLGCEXT": "4218822", "I_MPI_INFO_FLGD": "395049983",
    "I_MPI_INFO_FLGDEXT": "272", "I_MPI_INFO_LCPU": "2", "I_MPI_INFO_MODE": "263", "I_MPI_INFO_NC": "2",
    "I_MPI_INFO_NP": "1", "I_MPI_INFO_NUMA_NODE_MAP": "", "I_MPI_INFO_NUMA_NODE_NUM": "1", "I_MPI_INFO_PACK": "0,0",
    "I_MPI_INFO_SERIAL": "0000", "I_MPI_INFO_SIGN": "11538209", "I_MPI_INFO_STATE": "0", "I_MPI_INFO_THREAD": "0,0",
    "I_MPI_INFO_VEND": "0", "I_MPI_INTERNAL_MEM_POLICY": "default", "I_MPI_PIN_INFO": "1",
    "I_MPI_PIN_MAPPING": "2:0 0,1 1", "I_MPI_RETURN_WIN_MEM_NUMA": "-1,0", "MPI_LOCALNRANKS": "2",
    "MPI_LOCALRANKID": "1", "PMI_FD": "11", "PMI_RANK": "1", "PMI_SIZE": "2",
}
#: RECORDED: the same with Intel's ``mpirun`` (a script around mpiexec), which adds I_MPI_MPIRUN.
INTEL_MPIRUN = {**INTEL_MPI, "I_MPI_MPIRUN": "mpirun", "I_MPI_HYDRA_UUID": "973a0000-bbf8-b817-ea60-0600e1037c0d"}
#: MPICH's mpiexec in an environment with Intel MPI options a user exported (or I_MPI_ROOT from a
#: module): still MPICH's launcher.
MPICH_WITH_I_MPI_OPTIONS = {**MPICH, "I_MPI_ROOT": "/opt/intel/oneapi/mpi/2021.13", "I_MPI_FABRICS": "shm:ofi",
                            "I_MPI_PIN": "0"}


def _slurm_step(procid: int, localid: int, nodeid: int, node: str, ntasks=4, nodes=2, per_node="2(x2)") -> dict:
    """FROM DOCUMENTATION: what srun (SLURM 22.05, srun(1) OUTPUT ENVIRONMENT
    VARIABLES) gives task ``procid`` of a step of ``ntasks`` tasks on ``nodes``
    nodes n1..nN, with no --mpi plugin.  Not recorded on a real SLURM."""
    return {
        "SLURM_CLUSTER_NAME": "hpccomm", "SLURM_CPUS_ON_NODE": "4", "SLURM_CPUS_PER_TASK": "1",
        "SLURM_DISTRIBUTION": "cyclic", "SLURM_GTIDS": "2,3", "SLURM_JOB_ACCOUNT": "root",
        "SLURM_JOB_CPUS_PER_NODE": f"4(x{nodes})", "SLURM_JOB_GID": "0", "SLURM_JOB_ID": "42",
        "SLURM_JOBID": "42", "SLURM_JOB_NAME": "train", "SLURM_JOB_NODELIST": f"n[1-{nodes}]",
        "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_JOB_PARTITION": "debug", "SLURM_JOB_QOS": "normal",
        "SLURM_JOB_UID": "0", "SLURM_JOB_USER": "root", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.1",
        "SLURM_LOCALID": str(localid), "SLURM_NNODES": str(nodes), "SLURM_NODEID": str(nodeid),
        "SLURM_NODELIST": f"n[1-{nodes}]", "SLURM_NPROCS": str(ntasks), "SLURM_NTASKS": str(ntasks),
        "SLURM_NTASKS_PER_NODE": "2", "SLURM_PRIO_PROCESS": "0", "SLURM_PROCID": str(procid),
        "SLURM_SRUN_COMM_HOST": "10.0.0.1", "SLURM_SRUN_COMM_PORT": "40123", "SLURM_STEPID": "0",
        "SLURM_STEP_ID": "0", "SLURM_STEP_LAUNCHER_PORT": "40123", "SLURM_STEP_NODELIST": f"n[1-{nodes}]",
        "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_STEP_TASKS_PER_NODE": per_node, "SLURM_SUBMIT_DIR": "/home/user", "SLURM_SUBMIT_HOST": "login1",
        "SLURM_TASK_PID": "31337", "SLURM_TASKS_PER_NODE": per_node, "SLURM_TOPOLOGY_ADDR": node,
        "SLURM_TOPOLOGY_ADDR_PATTERN": "node", "SLURM_UMASK": "0022", "SLURMD_NODENAME": node,
    }


#: FROM DOCUMENTATION: task 3 (second task on node n2) of ``srun -N2 --ntasks-per-node 2 --mpi=...``.
SRUN_NONE = _slurm_step(3, 1, 1, "n2")
#: mpi/pmix plugin: PMIx server variables (as Open MPI's above) with SLURM's namespace.
SRUN_PMIX = {**SRUN_NONE, "PMIX_RANK": "3", "PMIX_NAMESPACE": "slurm.pmix.42.0", "PMIX_VERSION": "4.2.2",
             "PMIX_SERVER_URI41": "pmix-server.12345;tcp4://127.0.0.1:34567", "PMIX_SECURITY_MODE": "munge,native",
             "PMIX_GDS_MODULE": "ds21,ds12,hash", "PMIX_HOSTNAME": "n2",
             "PMIX_SERVER_TMPDIR": "/tmp/slurm/spmix_appdir_0_42.0",
             "PMIX_SYSTEM_TMPDIR": "/tmp", "SLURM_PMIXP_ABORT_AGENT_PORT": "41000"}
#: mpi/pmi2 plugin (slurm's src/plugins/mpi/pmi2: PMI_FD, PMI_JOBID, PMI_RANK, PMI_SIZE).
SRUN_PMI2 = {**SRUN_NONE, "PMI_FD": "5", "PMI_JOBID": "42.0", "PMI_RANK": "3", "PMI_SIZE": "4"}
#: An sbatch script itself (not a step): the allocation's variables, no SLURM_STEP_* of a real step.
SBATCH_SCRIPT = {k: v for k, v in SRUN_NONE.items()
                 if not k.startswith(("SLURM_STEP", "SLURM_STEPID", "SLURM_SRUN", "SLURM_LAUNCH", "SLURM_GTIDS"))}
SBATCH_SCRIPT.update(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0", SLURMD_NODENAME="n1")
SBATCH_SCRIPT_BATCH_STEP = {**SBATCH_SCRIPT, "SLURM_STEP_ID": "4294967291"}  # SLURM_BATCH_SCRIPT pseudo-step

#: RECORDED on the two-node test SLURM (tests/slurm/cluster.sh, SLURM 22.05): task 3 (second task on n2) of
#: ``srun -N2 --ntasks-per-node=2 --mpi=pmi2`` with the MPICH wheel's Python (``env -i`` first).
SRUN_PMI2_MPICH = {
    "PMI_FD": "13", "PMI_JOBID": "3.0", "PMI_RANK": "3", "PMI_SIZE": "4", "SLURMD_NODENAME": "n2",
    "SLURM_CLUSTER_NAME": "hpccomm-test", "SLURM_CPUS_ON_NODE": "2", "SLURM_GTIDS": "2,3", "SLURM_JOBID": "3",
    "SLURM_JOB_CPUS_PER_NODE": "2(x2)", "SLURM_JOB_GID": "0", "SLURM_JOB_ID": "3", "SLURM_JOB_NAME": "bash",
    "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_PARTITION": "debug", "SLURM_JOB_UID": "0",
    "SLURM_JOB_USER": "root", "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1", "SLURM_LOCALID": "1", "SLURM_MPI_TYPE": "pmi2",
    "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_NODELIST": "n[1-2]", "SLURM_NPROCS": "4", "SLURM_NTASKS": "4",
    "SLURM_NTASKS_PER_NODE": "2", "SLURM_PRIO_PROCESS": "0", "SLURM_PROCID": "3", "SLURM_SRUN_COMM_HOST": "127.0.0.1",
    "SLURM_SRUN_COMM_PORT": "39435", "SLURM_STEPID": "0", "SLURM_STEP_ID": "0", "SLURM_STEP_LAUNCHER_PORT": "39435",
    "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_SUBMIT_DIR": "/tmp/fam", "SLURM_SUBMIT_HOST": "vm",
    "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_TASK_PID": "21197", "SLURM_TOPOLOGY_ADDR": "n2",
    "SLURM_TOPOLOGY_ADDR_PATTERN": "node", "SLURM_UMASK": "0022",
    "SLURM_WORKING_CLUSTER": "hpccomm-test:localhost:7917:9728:109", "SRUN_DEBUG": "3",
}
#: RECORDED there too: rank 3 of MPICH's ``mpirun`` (Hydra) inside ``salloc -N2 --ntasks-per-node=2``: Hydra's
#: variables, and the SLURM_* of the one-task-per-node step that runs Hydra's proxies.
MPICH_MPIRUN_IN_SLURM = {
    "GFORTRAN_UNBUFFERED_PRECONNECTED": "y", "MPI_LOCALNRANKS": "2", "MPI_LOCALRANKID": "1", "PMI_FD": "6",
    "PMI_HOSTNAME": "n2", "PMI_RANK": "3", "PMI_SIZE": "4", "SLURMD_NODENAME": "n2",
    "SLURM_CLUSTER_NAME": "hpccomm-test", "SLURM_CPUS_ON_NODE": "2", "SLURM_DISTRIBUTION": "cyclic",
    "SLURM_EXTERNAL_LAUNCHER": "1", "SLURM_GTIDS": "1", "SLURM_JOBID": "8", "SLURM_JOB_CPUS_PER_NODE": "2(x2)",
    "SLURM_JOB_CPUS_PER_NODE_PACK_GROUP_0": "2(x2)", "SLURM_JOB_GID": "0", "SLURM_JOB_ID": "8",
    "SLURM_JOB_NAME": "interactive", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2",
    "SLURM_JOB_PARTITION": "debug", "SLURM_JOB_UID": "0", "SLURM_JOB_USER": "root",
    "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1", "SLURM_LOCALID": "0", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
    "SLURM_NODELIST": "n[1-2]", "SLURM_NODE_ALIASES": "(null)", "SLURM_NPROCS": "2", "SLURM_NTASKS": "2",
    "SLURM_NTASKS_PER_NODE": "2", "SLURM_PRIO_PROCESS": "0", "SLURM_PROCID": "1", "SLURM_SRUN_COMM_HOST": "127.0.0.1",
    "SLURM_SRUN_COMM_PORT": "44311", "SLURM_STEPID": "1", "SLURM_STEP_ID": "1", "SLURM_STEP_LAUNCHER_PORT": "44311",
    "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_SUBMIT_DIR": "/tmp/fam", "SLURM_SUBMIT_HOST": "vm",
    "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_TASK_PID": "21633", "SLURM_TOPOLOGY_ADDR": "n2",
    "SLURM_TOPOLOGY_ADDR_PATTERN": "node", "SLURM_UMASK": "0022",
    "SLURM_WORKING_CLUSTER": "hpccomm-test:localhost:7917:9728:109", "SRUN_DEBUG": "3",
}
#: RECORDED there too: rank 3 of Intel MPI's ``mpirun`` in the same allocation (its bootstrap: slurm).
INTEL_MPIRUN_IN_SLURM = {
    "GFORTRAN_UNBUFFERED_PRECONNECTED": "y", "HYDRA_BSTRAP_DEBUG": "0", "HYDRA_BSTRAP_DOWNSTREAM_CONTROL": "",
    "HYDRA_BSTRAP_DOWNSTREAM_HOSTS": "", "HYDRA_BSTRAP_DOWNSTREAM_PID": "", "HYDRA_BSTRAP_DOWNSTREAM_STDERR": "",
    "HYDRA_BSTRAP_DOWNSTREAM_STDOUT": "", "HYDRA_BSTRAP_LAUNCHER": "slurm", "HYDRA_BSTRAP_LOCALHOST": "n2",
    "HYDRA_BSTRAP_NODE_ID": "1", "HYDRA_BSTRAP_NUM_DOWNSTREAM_PROXIES": "0", "HYDRA_BSTRAP_NUM_LAUNCHES": "-1",
    "HYDRA_BSTRAP_PGID": "0", "HYDRA_BSTRAP_PROXY_ID": "1", "HYDRA_BSTRAP_SUBTREE_SIZE": "1",
    "HYDRA_BSTRAP_TREE_WIDTH": "2", "HYDRA_BSTRAP_UPSTREAM_FD": "3", "HYDRA_IP_VERSION": "2",
    "HYDRA_LAUNCH_TYPE": "0", "I_MPI_BIND_WIN_ALLOCATE": "localalloc", "I_MPI_HYDRA_BOOTSTRAP": "slurm",
    "I_MPI_HYDRA_TOPOLIB": "ipl2", "I_MPI_HYDRA_UUID": "c3550000-f41c-5fdd-ea60-0600e810894f",
    "I_MPI_INFO_BRAND": "AMD EPYC", "I_MPI_INFO_CACHE1": "0,1", "I_MPI_INFO_CACHE2": "0,1",
    "I_MPI_INFO_CACHE3": "0,0", "I_MPI_INFO_CACHES": "3", "I_MPI_INFO_CACHE_SHARE": "0,0,0",
    "I_MPI_INFO_CACHE_SIZE": "0,0,0", "I_MPI_INFO_CORE": "0,1", "I_MPI_INFO_C_NAME": "Unknown",
    "I_MPI_INFO_DESC": "0", "I_MPI_INFO_FLGB": "-239138901", "I_MPI_INFO_FLGC": "-380413",
    "I_MPI_INFO_FLGCEXT": "4218822", "I_MPI_INFO_FLGD": "395049983", "I_MPI_INFO_FLGDEXT": "272",
    "I_MPI_INFO_LCPU": "2", "I_MPI_INFO_MODE": "263", "I_MPI_INFO_NC": "2", "I_MPI_INFO_NP": "1",
    "I_MPI_INFO_NUMA_NODE_MAP": "", "I_MPI_INFO_NUMA_NODE_NUM": "1", "I_MPI_INFO_PACK": "0,0",
    "I_MPI_INFO_SERIAL": "0000", "I_MPI_INFO_SIGN": "11538209", "I_MPI_INFO_STATE": "0", "I_MPI_INFO_THREAD": "0,0",
    "I_MPI_INFO_VEND": "0", "I_MPI_INTERNAL_MEM_POLICY": "default", "I_MPI_MPIRUN": "mpirun", "I_MPI_PIN_INFO": "1",
    "I_MPI_PIN_MAPPING": "2:2 0,3 1", "I_MPI_RETURN_WIN_MEM_NUMA": "-1,0", "MPI_LOCALNRANKS": "2",
    "MPI_LOCALRANKID": "1", "PMI_FD": "6", "PMI_RANK": "3", "PMI_SIZE": "4", "SLURMD_NODENAME": "n2",
    "SLURM_CLUSTER_NAME": "hpccomm-test", "SLURM_CPUS_ON_NODE": "2", "SLURM_DISTRIBUTION": "cyclic",
    "SLURM_GTIDS": "1", "SLURM_JOBID": "11", "SLURM_JOB_CPUS_PER_NODE": "2(x2)",
    "SLURM_JOB_CPUS_PER_NODE_PACK_GROUP_0": "2(x2)", "SLURM_JOB_GID": "0", "SLURM_JOB_ID": "11",
    "SLURM_JOB_NAME": "interactive", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2",
    "SLURM_JOB_PARTITION": "debug", "SLURM_JOB_UID": "0", "SLURM_JOB_USER": "root",
    "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1", "SLURM_LOCALID": "0", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
    "SLURM_NODELIST": "n[1-2]", "SLURM_NODE_ALIASES": "(null)", "SLURM_NPROCS": "2", "SLURM_NTASKS": "4",
    "SLURM_NTASKS_PER_NODE": "2", "SLURM_PRIO_PROCESS": "0", "SLURM_PROCID": "1", "SLURM_SRUN_COMM_HOST": "127.0.0.1",
    "SLURM_SRUN_COMM_PORT": "32925", "SLURM_STEPID": "1", "SLURM_STEP_ID": "1", "SLURM_STEP_LAUNCHER_PORT": "32925",
    "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_SUBMIT_DIR": "/tmp/fam", "SLURM_SUBMIT_HOST": "vm",
    "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_TASK_PID": "21996", "SLURM_TOPOLOGY_ADDR": "n2",
    "SLURM_TOPOLOGY_ADDR_PATTERN": "node", "SLURM_UMASK": "0022",
    "SLURM_WORKING_CLUSTER": "hpccomm-test:localhost:7917:9728:109", "SRUN_DEBUG": "3",
}

#: Nested launches (FROM DOCUMENTATION): the inner launcher's ranks inherit the
#: SLURM_* of the step that started the inner launcher's daemons, one per node.
_DAEMON_STEP = _slurm_step(1, 0, 1, "n2", ntasks=2, nodes=2, per_node="1(x2)")
MPIRUN_IN_SLURM = {**_DAEMON_STEP, **{k: v for k, v in OPEN_MPI.items()},
                   "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "PMIX_RANK": "3"}
MPIEXEC_IN_SLURM = {**_DAEMON_STEP, **MPICH, "PMI_RANK": "3", "PMI_SIZE": "4"}
TORCHRUN_IN_SRUN = {**_DAEMON_STEP, **TORCHRUN, "RANK": "3", "WORLD_SIZE": "4", "GROUP_RANK": "1",
                    "GROUP_WORLD_SIZE": "2"}


def L(name, rank, size, local_rank, local_size, node, command, rank_var=None, size_var=None, pmi=None):
    return Launch(name, rank, size, local_rank, local_size, node, command, rank_var, size_var, pmi)


CASES = {
    "openmpi": (OPEN_MPI, L("openmpi", 1, 2, 1, 2, None, "mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")),
    "mpich": (MPICH, L("mpich", 1, 2, 1, 2, None, "mpiexec", "PMI_RANK", "PMI_SIZE")),
    "intelmpi": (INTEL_MPI, L("intelmpi", 1, 2, 1, 2, None, "mpiexec", "PMI_RANK", "PMI_SIZE")),
    "intelmpi-mpirun": (INTEL_MPIRUN, L("intelmpi", 1, 2, 1, 2, None, "mpirun", "PMI_RANK", "PMI_SIZE")),
    "mpich-with-intel-options": (MPICH_WITH_I_MPI_OPTIONS, L("mpich", 1, 2, 1, 2, None, "mpiexec", "PMI_RANK",
                                                            "PMI_SIZE")),
    "torchrun": (TORCHRUN, L("torchrun", 1, 2, 1, 2, 0, "torchrun", "RANK", "WORLD_SIZE")),
    "srun-none": (SRUN_NONE, L("srun", 3, 4, 1, 2, 1, "srun", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")),
    "srun-pmix": (SRUN_PMIX, L("srun", 3, 4, 1, 2, 1, "srun", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "pmix")),
    "srun-pmi2": (SRUN_PMI2, L("srun", 3, 4, 1, 2, 1, "srun", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "pmi2")),
    "sbatch-script": (SBATCH_SCRIPT, L("single", 0, 1, 0, 1, 0, "python")),
    "sbatch-batch-step": (SBATCH_SCRIPT_BATCH_STEP, L("single", 0, 1, 0, 1, 0, "python")),
    "plain": ({"PATH": "/usr/bin", "HOME": "/root"}, L("single", 0, 1, 0, 1, 0, "python")),
    "mpirun-in-slurm": (MPIRUN_IN_SLURM, L("openmpi", 3, 4, 1, 2, None, "mpirun", "OMPI_COMM_WORLD_RANK",
                                           "OMPI_COMM_WORLD_SIZE")),
    "mpiexec-in-slurm": (MPIEXEC_IN_SLURM, L("mpich", 3, 4, 1, 2, None, "mpiexec", "PMI_RANK", "PMI_SIZE")),
    "torchrun-in-srun": (TORCHRUN_IN_SRUN, L("torchrun", 3, 4, 1, 2, 1, "torchrun", "RANK", "WORLD_SIZE")),
    "srun-pmi2-mpich": (SRUN_PMI2_MPICH, L("srun", 3, 4, 1, 2, 1, "srun", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS",
                                           "pmi2")),
    "mpich-mpirun-in-slurm": (MPICH_MPIRUN_IN_SLURM, L("mpich", 3, 4, 1, 2, None, "mpiexec", "PMI_RANK",
                                                       "PMI_SIZE")),
    "intelmpi-mpirun-in-slurm": (INTEL_MPIRUN_IN_SLURM, L("intelmpi", 3, 4, 1, 2, None, "mpirun", "PMI_RANK",
                                                          "PMI_SIZE")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_detect(case):
    env, expected = CASES[case]
    assert launcher.detect(env) == expected


def test_every_launcher_has_a_case_and_constants():
    """Each registered class is exercised by a recorded or documented
    environment, and names its variables as upper-case class constants."""
    names = [cls.name for cls in launcher.launchers()]
    assert names == ["torchrun", "openmpi", "intelmpi", "mpich", "srun", "single"], names
    assert {exp.name for _, exp in CASES.values()} == set(names)
    for cls in launcher.launchers():
        consts = {k: v for k, v in vars(cls).items() if k.isupper() and isinstance(v, str)}
        if cls.name != "single":
            assert consts and all(v.isupper() for v in consts.values()), (cls, consts)


def test_detect_reads_os_environ(monkeypatch):
    for k in list(os.environ):
        monkeypatch.delenv(k)
    for k, v in MPICH.items():
        monkeypatch.setenv(k, v)
    assert hpccomm.launcher() == launcher.detect() == CASES["mpich"][1]
    assert isinstance(hpccomm.launcher(), Launch)


@pytest.mark.parametrize("env,expected", [
    ({"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "-4"}, L("openmpi", None, None, None, None, None,
                                                                    "mpirun", "OMPI_COMM_WORLD_RANK",
                                                                    "OMPI_COMM_WORLD_SIZE")),
    ({"PMI_SIZE": "8"}, L("mpich", None, 8, None, None, None, "mpiexec", "PMI_RANK", "PMI_SIZE")),
    ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "4"}, L("srun", None, 4, None, None, None, "srun", "SLURM_PROCID",
                                                     "SLURM_NTASKS")),
    ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "4", "SLURM_NODEID": "7", "SLURM_TASKS_PER_NODE": "2(x2)"},
     L("srun", None, 4, None, None, 7, "srun", "SLURM_PROCID", "SLURM_NTASKS")),   # node past the list
    ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "3", "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "2,1",
      "SLURM_PROCID": "2", "SLURM_LOCALID": "0"}, L("srun", 2, 3, 0, 1, 1, "srun", "SLURM_PROCID", "SLURM_NTASKS")),
    ({"SLURM_STEP_ID": "junk", "SLURM_NTASKS": "4"}, L("single", 0, 1, 0, 1, 0, "python")),
    ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_MPI_TYPE": "cray_shasta"},   # srun says which plugin
     L("srun", None, 2, None, None, None, "srun", "SLURM_PROCID", "SLURM_NTASKS", "cray_shasta")),
    ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_MPI_TYPE": "none"},
     L("srun", None, 2, None, None, None, "srun", "SLURM_PROCID", "SLURM_NTASKS")),
    ({"TORCHELASTIC_RUN_ID": "none"}, L("torchrun", None, None, None, None, None, "torchrun", "RANK", "WORLD_SIZE")),
])
def test_partial_or_malformed_environment(env, expected):
    """Whatever is missing or not a number comes out None; nothing raises."""
    assert launcher.detect(env) == expected


@pytest.mark.parametrize("spec,expected", [
    ("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,2,3", [1, 2, 3]), ("16(x128)", [16] * 128),
    ("", None), ("2(x)", None), ("a", None), ("2(x3)1", None),
])
def test_tasks_per_node(spec, expected):
    assert launcher.tasks_per_node(spec) == expected


def test_is_torchelastic_launched(monkeypatch):
    assert launcher.is_torchelastic_launched(TORCHRUN) and launcher.is_torchelastic_launched(TORCHRUN_IN_SRUN)
    assert not any(launcher.is_torchelastic_launched(env) for env in (OPEN_MPI, MPICH, SRUN_PMIX, {}))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    import torch.distributed as dist

    assert hpccomm.is_torchelastic_launched() is dist.is_torchelastic_launched() is False
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert hpccomm.is_torchelastic_launched() is dist.is_torchelastic_launched() is True


@pytest.mark.parametrize("library,plugin", [
    (OPEN_MPI_LIBRARY, "pmix"), ("Open MPI v4.1.5, package: Debian OpenMPI", "pmix"), (MPICH_LIBRARY, "pmi2"),
    (INTEL_LIBRARY, "pmi2"), ("MVAPICH2 Version      :\t2.3.7", "pmi2"),
    ("MPI VERSION    : CRAY MPICH version 8.1.28.2 (ANL base 3.4a2)", "pmi2"), ("Some Vendor MPI 1.0", None),
])
def test_srun_mpi_plugin(library, plugin):
    assert launcher.srun_mpi_plugin(library) == plugin


@pytest.mark.parametrize("library,family", [
    (OPEN_MPI_LIBRARY, "openmpi"), ("Open MPI v4.1.5, package: Debian OpenMPI", "openmpi"),
    (MPICH_LIBRARY, "mpich"), ("MPICH Version:\t4.2.0", "mpich"), (INTEL_LIBRARY, "intelmpi"),
    ("Intel(R) MPI Library 2019 Update 12 for Linux* OS", "intelmpi"),
    ("MVAPICH2 Version      :\t2.3.7", None), ("MPI VERSION    : CRAY MPICH version 8.1.28.2", None),
    ("Microsoft MPI 10.1", None), ("", None),
])
def test_family_of(library, family):
    found = launcher.family_of(library)
    assert (found.name if found else None) == family


@pytest.mark.parametrize("library,family", [
    (OPEN_MPI_LIBRARY, "openmpi"), (MPICH_LIBRARY, "mpich"), (INTEL_LIBRARY, "intelmpi"),
    ("MVAPICH2 Version      :\t2.3.7", "mvapich"), ("MPI VERSION    : CRAY MPICH version 8.1.28.2", "cray"),
    ("Microsoft MPI 10.1", None), ("", None),
])
def test_library_family(library, family):
    """Every family of the one table, launched by hpccomm or not (Cray
    MPICH's text names MPICH too: the longer mark decides)."""
    found = launcher.library_family(library)
    assert (found.name if found else None) == family


def test_families_say_how_each_is_launched():
    """The launch facts of each family (docs/mpi-families.md): Hydra (MPICH,
    Intel MPI) needs no flag to start more ranks than cores and tags output
    with -prepend-rank; Open MPI needs --oversubscribe and --output tag, and
    two variables to run as root.  The one table of families also holds
    MPICH's derivatives hpccomm does not launch (no launcher of their own:
    family_of leaves them out), for the srun plugin and the CUDA probes."""
    assert sorted(launcher.FAMILIES) == ["cray", "intelmpi", "mpich", "mvapich", "openmpi"]
    fams = {name: f for name, f in launcher.FAMILIES.items() if f.launcher is not None}
    assert sorted(fams) == ["intelmpi", "mpich", "openmpi"]
    assert [(f.launcher, f.oversubscribe, f.rank_output, f.srun_mpi) for f in fams.values()] == [
        ("mpirun", ("--oversubscribe",), ("--output", "tag"), "pmix"),
        ("mpiexec", (), ("-prepend-rank",), "pmi2"),
        ("mpiexec", (), ("-prepend-rank",), "pmi2"),
    ]
    assert dict(fams["openmpi"].as_root) == {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    assert fams["mpich"].as_root == fams["intelmpi"].as_root == ()
    # each family's own launcher is the Launch name of that family, and the command its detection reports
    assert {f.name for f in fams.values()} <= {cls.name for cls in launcher.launchers()}
    assert all(cls.command == fams[cls.name].launcher for cls in launcher.launchers() if cls.name in fams)
    # every family says what makes it CUDA-aware and which srun plugin connects it; those launched, the others
    assert all(f.cuda_advice and f.srun_mpi for f in launcher.FAMILIES.values())
    assert all(f.srun_others for f in fams.values())


def test_module_is_callable_and_importable():
    """``hpccomm.launcher`` is the module, and calling it detects (a function
    exported under the module's name would hide the module)."""
    import importlib

    mod = importlib.import_module("hpccomm.launcher")
    assert hpccomm.launcher is mod and mod.detect is launcher.detect
    assert callable(hpccomm.launcher) and hpccomm.launcher(MPICH) == CASES["mpich"][1]
    for name in ("launcher", "Launch", "is_torchelastic_launched", "is_mpi_available", "is_nccl_available",
                 "is_available"):
        assert name in hpccomm.__all__ and hasattr(hpccomm, name), name


def test_launcher_module_is_pure():
    """launcher.py parses the environment and nothing else."""
    from test_layers import imports_of

    source = Path(launcher.__file__).read_text()
    names = {name for _, name, _ in imports_of(source, "hpccomm.launcher")}
    assert names <= {"__future__", "__future__.annotations", "os", "re", "sys", "dataclasses",
                     "dataclasses.dataclass", "dataclasses.replace", "typing", "typing.ClassVar", "typing.Mapping",
                     "typing.Optional"}, names


# --------------------------------------------------------------------------
# availability
# --------------------------------------------------------------------------

def test_is_mpi_available_does_not_start_mpi():
    """Checked in a fresh process: True here (mpi4py and the venv's MPI
    wheel), and mpi4py.MPI is not imported, so MPI is not initialised; the
    family and its launcher are found the same way."""
    code = ("import sys, hpccomm; from hpccomm._mpi import library; p = library.probe(); f = library.family(); "
            "print(hpccomm.is_mpi_available(), 'mpi4py.MPI' in sys.modules, p.abi, f.name, library.launcher_path(), "
            "'mpi4py.MPI' in sys.modules); print(p.library)")
    first, library = _python(code).splitlines()[:2]
    mpi = require()
    abi = {"openmpi": "openmpi", "mpich": "mpich", "intelmpi": "mpich"}[mpi.family]
    assert first.split() == ["True", "False", abi, mpi.family, mpi.launcher, "False"], first
    assert launcher.family_of(library).name == mpi.family, library


def test_is_mpi_available_false_without_a_library(tmp_path):
    """MPI4PY_LIBMPI pointing at no library: False, with the reason."""
    code = ("import sys, hpccomm; from hpccomm._mpi import library; p = library.probe(); "
            "print(hpccomm.is_mpi_available(), 'mpi4py.MPI' in sys.modules); print(p.reason)")
    out = _python(code, MPI4PY_LIBMPI=str(tmp_path / "libnothing.so"))
    first, reason = out.splitlines()[:2]
    assert first == "False False" and reason.startswith("no MPI library could be loaded: cannot load MPI library"), out


def test_is_nccl_available_on_this_build():
    import torch
    import torch.distributed as dist

    assert hpccomm.is_nccl_available() is (dist.is_nccl_available() or _has_cupy_nccl())
    if not torch.cuda.is_available():
        assert hpccomm.is_nccl_available() is dist.is_nccl_available()


def _has_cupy_nccl() -> bool:
    try:
        from cupy.cuda import nccl  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def _python(code: str, **env) -> str:
    full = {k: v for k, v in os.environ.items()
            if not k.startswith(("OMPI_", "PMIX_", "PMI_", "PRTE_", "SLURM_", "HYDI_", "MPI_LOCAL"))}
    full.update(PYTHONPATH=str(REPO), **env)
    proc = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


# --------------------------------------------------------------------------
# the launch checks at init, with a fake COMM_WORLD (no MPI)
# --------------------------------------------------------------------------

class _World:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size


@pytest.mark.parametrize("case,library,message", [
    ("srun-none", OPEN_MPI_LIBRARY,
     "hpccomm init: srun started 4 processes (SLURM_STEP_NUM_TASKS=4) but MPI sees a world of 1: every rank would "
     f"run alone. Launch with srun --mpi=pmix: the MPI library in use is {OPEN_MPI_LIBRARY}, and this step was "
     "given --mpi=none (no PMI) (`srun --mpi=list` shows the plugins this SLURM has; MpiDefault in slurm.conf "
     "sets the default)"),
    ("srun-pmi2", OPEN_MPI_LIBRARY, "Launch with srun --mpi=pmix: the MPI library in use is Open MPI v5.0.11"),
    ("srun-pmi2", OPEN_MPI_LIBRARY, "this step was given --mpi=pmi2 ("),
    ("srun-pmix", MPICH_LIBRARY, "Launch with srun --mpi=pmi2: the MPI library in use is MPICH Version:      5.0.2, "
                                 "and this step was given --mpi=pmix ("),
    ("srun-none", INTEL_LIBRARY, "Launch with srun --mpi=pmi2: the MPI library in use is Intel(R) MPI"),
    ("srun-none", "Some Vendor MPI 1.0",
     "Launch with srun --mpi=pmix (Open MPI) or srun --mpi=pmi2 (MPICH, Intel MPI), whichever fits the MPI library "
     "in use (Some Vendor MPI 1.0); this step was given --mpi=none (no PMI)"),
    ("openmpi", MPICH_LIBRARY,
     "hpccomm init: mpirun started 2 processes (OMPI_COMM_WORLD_SIZE=2) but MPI sees a world of 1: every rank "
     "would run alone. Launch with the mpirun/mpiexec of the MPI library mpi4py uses (MPICH Version:      5.0.2), "
     "not another library's"),
    ("mpich", OPEN_MPI_LIBRARY, "hpccomm init: mpiexec started 2 processes (PMI_SIZE=2) but MPI sees a world of 1"),
    ("intelmpi", OPEN_MPI_LIBRARY, "hpccomm init: mpiexec started 2 processes (PMI_SIZE=2)"),
    ("torchrun", OPEN_MPI_LIBRARY,
     "hpccomm init: torchrun started 2 processes (WORLD_SIZE=2) but MPI sees a world of 1: every rank would run "
     "alone. torchrun does not start MPI, so hpccomm cannot join its processes into one MPI world. Launch with "
     "mpirun -n 2 (or srun --mpi=pmix) instead: hpccomm needs no MASTER_ADDR, RANK or WORLD_SIZE"),
])
def test_silent_singleton_names_the_fix(case, library, message):
    env = CASES[case][0]
    with pytest.raises(hpccomm.InitError) as info:
        bootstrap._check_launch(_World(0, 1), env, library)
    text = str(info.value)
    assert message in text, text
    assert "  " not in text.replace(MPICH_LIBRARY, "MPICH"), text


@pytest.mark.parametrize("case", sorted(CASES))
def test_agreeing_launch_passes(case):
    env, launch = CASES[case]
    bootstrap._check_launch(_World(launch.rank or 0, launch.size or 1), env, "unused")


@pytest.mark.parametrize("case,rank,size,said", [
    ("openmpi", 0, 2, "mpirun says this process is rank 1 of 2 (OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_SIZE=2) "
                      "but MPI says rank 0 of 2"),
    ("srun-pmix", 3, 8, "srun says this process is rank 3 of 4 (SLURM_PROCID=3, SLURM_STEP_NUM_TASKS=4) but MPI "
                        "says rank 3 of 8"),
    ("torchrun", 1, 3, "torchrun says this process is rank 1 of 2 (RANK=1, WORLD_SIZE=2) but MPI says rank 1 of 3"),
])
def test_launcher_and_mpi_disagree(case, rank, size, said):
    with pytest.raises(hpccomm.InitError) as info:
        bootstrap._check_launch(_World(rank, size), CASES[case][0], OPEN_MPI_LIBRARY)
    text = str(info.value)
    assert text.startswith("hpccomm init: " + said + ": two launchers or two MPI libraries are mixed. Start the job "
                           "with one launcher, the one of the MPI library in use (Open MPI v5.0.11"), text


# --------------------------------------------------------------------------
# real launches
# --------------------------------------------------------------------------

SCRIPT = '''
import json, os, sys
import hpccomm
from dataclasses import asdict
launch = asdict(hpccomm.launcher())
out = {"launch": launch, "elastic": hpccomm.is_torchelastic_launched()}
how = sys.argv[1] if len(sys.argv) > 1 else "hpccomm"
try:
    if how == "hpccomm":
        hpccomm.init_process_group()
    else:
        import torch.distributed as dist
        dist.init_process_group("hpccomm")
except hpccomm.InitError as exc:
    out["error"] = str(exc)
else:
    import torch.distributed as dist
    out.update(rank=dist.get_rank(), size=dist.get_world_size(), local_rank=hpccomm.local_rank(),
               local_size=hpccomm.local_size(), node=hpccomm.node_index())
    dist.destroy_process_group()
print("HPCCOMM-TEST " + json.dumps(out), flush=True)
'''


def _launch(cmd: list, tmp_path: Path) -> list:
    script = tmp_path / "who.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = require().env()
    full = ["timeout", "--kill-after=10", str(TIMEOUT - 15)] + [str(script) if c == "SCRIPT" else c for c in cmd]
    proc = subprocess.run(full, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT)
    # Each report is one write, but two processes' writes (torchrun's workers share the pipe) can
    # land on one line: decode each report where it starts.
    reports = [json.JSONDecoder().raw_decode(chunk)[0] for chunk in proc.stdout.split("HPCCOMM-TEST ")[1:]]
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return sorted(reports, key=lambda r: r["launch"]["rank"])


def test_real_mpirun(tmp_path):
    """The MPI family's launcher with 3 ranks (Open MPI's mpirun, MPICH's
    mpiexec, Intel MPI's mpirun): hpccomm.launcher() names the family and its
    command, with the ranks MPI gives, and init (which cross-checks both)
    succeeds with the launcher's local ranks."""
    mpi = require()
    reports = _launch(mpi.argv(3, sys.executable, "SCRIPT"), tmp_path)
    assert len(reports) == 3, reports
    for r, rep in enumerate(reports):
        launch = rep["launch"]
        assert (launch["name"], launch["command"], launch["rank"], launch["size"], launch["local_size"],
                launch["node_index"], launch["rank_variable"]) == \
               (mpi.family, mpi.command_name, r, 3, 3, None, mpi.rank_variable), rep
        # Open MPI numbers local ranks its own way (not always in world-rank
        # order); hpccomm's local rank is the launcher's.
        assert "error" not in rep and (rep["rank"], rep["size"], rep["local_rank"], rep["local_size"], rep["node"]) \
            == (r, 3, launch["local_rank"], 3, 0), rep
        assert rep["elastic"] is False
    assert sorted(rep["launch"]["local_rank"] for rep in reports) == [0, 1, 2], reports


@pytest.mark.parametrize("how", ["hpccomm", "env"])
def test_real_torchrun_is_refused(tmp_path, how):
    """torchrun --nproc-per-node 2: launcher() says torchrun with torchrun's
    ranks; init is refused on both paths (torchrun starts no MPI, so each
    process sees an MPI world of 1) with the message saying to use mpirun."""
    reports = _launch([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "SCRIPT", how],
                      tmp_path)
    assert len(reports) == 2, reports
    for r, rep in enumerate(reports):
        launch = rep["launch"]
        assert (launch["name"], launch["rank"], launch["size"], launch["local_rank"], launch["local_size"],
                launch["node_index"]) == ("torchrun", r, 2, r, 2, 0), rep
        assert rep["elastic"] is True
        assert rep.get("error", "").startswith(
            "hpccomm init: torchrun started 2 processes (WORLD_SIZE=2) but MPI sees a world of 1: every rank would "
            "run alone. torchrun does not start MPI"), rep
        assert f"Launch with mpirun -n 2 (or srun --mpi={require().spec.srun_mpi}) instead" in rep["error"], rep


def test_real_torchrun_refusal_ends_the_output(tmp_path):
    """A torchrun job whose init is refused, uncaught: the refusal is what
    torchrun's closing report names as the root cause, in the last lines of
    the job's output, not only in the workers' tracebacks above it."""
    script = tmp_path / "job.py"
    script.write_text("import hpccomm\nhpccomm.init_process_group()\n")
    proc = subprocess.run(["timeout", "--kill-after=10", str(TIMEOUT - 15), sys.executable, "-m",
                           "torch.distributed.run", "--nproc-per-node", "2", str(script)],
                          env=require().env(), cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = [x.strip() for x in proc.stderr.splitlines() if x.strip()][-2:]
    assert last[-2].startswith("traceback : hpccomm.errors.InitError: hpccomm init: torchrun started 2 processes "
                               "(WORLD_SIZE=2) but MPI sees a world of 1"), last
    assert set(last[-1]) == {"="}, last


def test_real_single_process(tmp_path):
    (rep,) = _launch([sys.executable, "SCRIPT"], tmp_path)
    assert rep["launch"] == asdict(L("single", 0, 1, 0, 1, 0, "python")), rep
    assert (rep["rank"], rep["size"], rep["local_rank"], rep["local_size"], rep["node"]) == (0, 1, 0, 1, 0), rep


def test_real_init_cross_checks_rank(tmp_path):
    """A plain process whose (torchrun) variables say rank 1 of 1 while MPI
    says rank 0 of 1: init refuses, naming both."""
    script = tmp_path / "who.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "PRTE_", "SLURM_", "HPCCOMM_", "MASTER_"))}
    env.update(PYTHONPATH=str(REPO), TORCHELASTIC_RUN_ID="test", RANK="1", WORLD_SIZE="1", LOCAL_RANK="1",
               TORCH_CPP_LOG_LEVEL="ERROR")
    proc = subprocess.run(["timeout", str(TIMEOUT - 15), sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout.split("HPCCOMM-TEST ", 1)[1])
    assert rep["error"].startswith("hpccomm init: torchrun says this process is rank 1 of 1 (RANK=1, WORLD_SIZE=1) "
                                   "but MPI says rank 0 of 1: two launchers or two MPI libraries are mixed."), rep


SUBCOMM = '''
import json, torch, torch.distributed as dist
import hpccomm
from mpi4py import MPI
w = MPI.COMM_WORLD
sub = w.Split(w.Get_rank() % 2, w.Get_rank())
hpccomm.init_process_group(comm=sub)
t = torch.ones(1)
dist.all_reduce(t)
print("HPCCOMM-TEST " + json.dumps({"launch": {"rank": w.Get_rank()}, "rank": dist.get_rank(),
                                    "size": dist.get_world_size(), "sum": t.item()}), flush=True)
dist.destroy_process_group()
'''


def test_real_init_on_a_subcommunicator_of_one(tmp_path):
    """mpirun -n 3, init_process_group(comm=...) with rank 1 alone in its
    communicator: the launch checks look at MPI_COMM_WORLD (which matches
    mpirun), so a communicator of one is not taken for the silent-singleton trap."""
    (tmp_path / "sub.py").write_text(SUBCOMM)
    reports = _launch(require().argv(3, sys.executable, str(tmp_path / "sub.py")), tmp_path)
    assert [(r["rank"], r["size"], r["sum"]) for r in reports] == [(0, 2, 2.0), (0, 1, 1.0), (1, 2, 2.0)], reports
