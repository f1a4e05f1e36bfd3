"""A process's place in a distributed job, read from Paddle's environment variables.

``role_from_env()`` turns the variables that ``flotilla launch`` (or a cluster scheduler, or a user by
hand) sets into a ``Role``, so one training script serves every role::

    role = role_from_env()
    t.transpile(role.trainer_id, pservers=role.pservers, trainers=role.trainers)
    if role.is_pserver: ...

Variables read (Paddle's names): ``TRAINING_ROLE`` (``PSERVER`` | ``TRAINER``), ``PADDLE_TRAINER_ID``,
``PADDLE_TRAINERS_NUM``, ``PADDLE_PSERVERS_IP_PORT_LIST`` (``ip:port,ip:port``),
``PADDLE_CURRENT_ENDPOINT`` (or ``POD_IP`` + ``PADDLE_PORT`` for a pserver), ``PADDLE_TRAINER_ENDPOINTS``.

Without Paddle's variables, a process started by ``mpirun``/``mpiexec`` (Open MPI, MPICH) or ``srun``
(Slurm) is a collective trainer whose rank and size are the scheduler's (``scheduler_env``).

Invariants:
- With none of these variables set (and no MPI or Slurm rank) the role is a local, single-process trainer (id 0 of 1 trainer, no
  pservers), so a script also runs standalone.
- A variable set to the empty string counts as unset. Roles are matched case-insensitively.
- Every invalid value raises ``LaunchError`` naming the variable, the value found, what was expected
  and how to fix it; nothing is guessed or silently dropped.
- Endpoints are kept in canonical ``host:port`` form (surrounding blanks dropped, the port as a plain
  decimal), so two spellings of one endpoint compare equal.
- This module imports only the standard library, ``ir.errors`` and ``ir.endpoints`` (no jax, no grpc): the launcher and
  light tools use it.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from ir import endpoints
from ir.endpoints import format_endpoint
from ir.errors import FlotillaError

PSERVER = "PSERVER"
TRAINER = "TRAINER"
ROLES = (PSERVER, TRAINER)

#: Every variable ``role_from_env`` reads; the launcher clears them from its own environment before
#: setting each child's, so nothing leaks from the caller's shell into a child's role.
ROLE_ENV_VARS = (
    "TRAINING_ROLE",
    "PADDLE_TRAINER_ID",
    "PADDLE_TRAINERS_NUM",
    "PADDLE_PSERVERS_IP_PORT_LIST",
    "PADDLE_CURRENT_ENDPOINT",
    "POD_IP",
    "PADDLE_PORT",
    "PADDLE_TRAINER_ENDPOINTS",
    "FLAGS_selected_gpus",
)

class LaunchError(FlotillaError):
    """A bad role environment or a bad launcher invocation.

    Codes: E801 unknown role, E802 a bad integer (trainer count or id), E803 a malformed endpoint or
    endpoint list, E804 a pserver without a valid endpoint of its own, E805 variables that contradict
    each other, E810 bad launcher arguments, E811 a port that cannot be used, E812 a missing file or
    an unusable log directory, E806 an MPI or Slurm environment that does not describe a job, E813 a job
    spanning hosts that this host cannot take part in (no address here, no shared secret).
    """

    code = "E800"


def parse_endpoint(text: str, where: str) -> tuple[str, int]:
    """``host:port`` → ``(host, port)`` (``ir.endpoints`` parses); ``where`` names the source (a variable
    or flag) for the error."""
    try:
        return endpoints.parse_endpoint(text, where)
    except endpoints.EndpointSyntaxError as err:
        raise LaunchError(err.message, hint=err.hint, code="E803") from None


def parse_endpoint_list(text: str, where: str) -> tuple[str, ...]:
    """A comma-separated endpoint list → canonical endpoints; empty items and duplicates are errors."""
    try:
        return endpoints.parse_endpoint_list(text, where)
    except endpoints.EndpointSyntaxError as err:
        raise LaunchError(err.message, hint=err.hint, code="E803") from None


@dataclass(frozen=True)
class Role:
    """Where this process stands in a job.

    ``role`` is ``PSERVER`` or ``TRAINER``; ``trainer_id`` is in ``0..trainers-1`` (a pserver has 0
    unless ``PADDLE_TRAINER_ID`` says otherwise: pserver programs do not depend on it);
    ``pserver_endpoints`` lists every pserver (empty: no parameter servers); ``current_endpoint`` is this
    process's own endpoint (a pserver's always; a trainer's when the trainer endpoints are known, else
    ``""``); ``trainer_endpoints`` lists every trainer's endpoint when known (collective mode needs it).
    Lists given to the constructor are stored as tuples.
    """

    role: str = TRAINER
    trainer_id: int = 0
    trainers: int = 1
    pserver_endpoints: tuple[str, ...] = ()
    current_endpoint: str = ""
    trainer_endpoints: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "pserver_endpoints", tuple(self.pserver_endpoints))
        object.__setattr__(self, "trainer_endpoints", tuple(self.trainer_endpoints))
        if self.role not in ROLES:
            raise LaunchError(f"Role.role is {self.role!r}, expected one of {', '.join(ROLES)}", code="E801")
        if self.trainers < 1:
            raise LaunchError(f"Role.trainers is {self.trainers}, expected at least 1", code="E802")
        if not 0 <= self.trainer_id < self.trainers:
            raise LaunchError(f"Role.trainer_id is {self.trainer_id}, expected 0..{self.trainers - 1} "
                              f"for {self.trainers} trainer(s)", code="E802")
        if self.trainer_endpoints and len(self.trainer_endpoints) != self.trainers:
            raise LaunchError(f"Role has {len(self.trainer_endpoints)} trainer endpoint(s) for {self.trainers} "
                              "trainer(s), expected one endpoint per trainer", code="E805")
        if self.role == PSERVER and self.current_endpoint not in self.pserver_endpoints:
            raise LaunchError(f"a pserver Role's current_endpoint {self.current_endpoint!r} is not one of its "
                              f"pserver_endpoints {list(self.pserver_endpoints)}", code="E804")

    @property
    def is_pserver(self) -> bool:
        return self.role == PSERVER

    @property
    def is_trainer(self) -> bool:
        return self.role == TRAINER

    @property
    def is_distributed(self) -> bool:
        """Whether the job has parameter servers."""
        return bool(self.pserver_endpoints)

    @property
    def is_collective(self) -> bool:
        """Whether this is a collective (allreduce) job: trainer endpoints known, no pservers."""
        return bool(self.trainer_endpoints) and not self.pserver_endpoints

    @property
    def pservers(self) -> str:
        """The pserver endpoints comma-joined, as ``DistributeTranspiler.transpile(pservers=...)`` takes."""
        return ",".join(self.pserver_endpoints)

    @property
    def pserver_index(self) -> int | None:
        """This pserver's position in ``pserver_endpoints``; None for a trainer."""
        return self.pserver_endpoints.index(self.current_endpoint) if self.is_pserver else None

    def ps_transpile_peers(self, hybrid: bool, what: str = "hybrid mode") -> tuple[int | str, str | None]:
        """The ``trainers`` and ``current_endpoint`` arguments of this process's parameter-server transpile:
        the trainer count and no endpoint, or in hybrid mode (the trainers form an allreduce group, so
        every process needs every trainer's endpoint) the trainer endpoints and, on a trainer, its own."""
        if not hybrid:
            return self.trainers, None
        if not self.trainer_endpoints:
            raise LaunchError(f"{what} needs every trainer's endpoint, but PADDLE_TRAINER_ENDPOINTS is not set",
                              hint="start the job with 'flotilla launch --server_num N --worker_num M', which "
                                   "sets it", code="E805")
        return ",".join(self.trainer_endpoints), self.current_endpoint if self.is_trainer else None


def _get(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def _get_int(env: Mapping[str, str], name: str, minimum: int, what: str) -> int | None:
    text = _get(env, name)
    if text is None:
        return None
    try:
        value = int(text, 10)
    except ValueError:
        raise LaunchError(f"{name}={text!r} is not an integer: expected {what}",
                          hint=f"set {name} to a decimal number such as {minimum}", code="E802") from None
    if value < minimum:
        raise LaunchError(f"{name}={text!r} is below {minimum}: expected {what}",
                          hint=f"set {name} to {minimum} or more", code="E802")
    return value


def role_from_env(environ: Mapping[str, str] | None = None) -> Role:
    """This process's ``Role`` from Paddle's variables in ``environ`` (``os.environ`` by default).

    Raises ``LaunchError`` naming the variable, its value and the fix for any invalid value.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    if not any(_get(env, name) for name in PADDLE_JOB_VARS):
        scheduled = scheduler_env(env)
        if scheduled is not None:
            env = {**env, **scheduled}
    role_text = _get(env, "TRAINING_ROLE")
    role = TRAINER if role_text is None else role_text.upper()
    if role not in ROLES:
        raise LaunchError(f"TRAINING_ROLE={role_text!r} is not a role: expected PSERVER or TRAINER",
                          hint="set TRAINING_ROLE=PSERVER for a parameter server or TRAINING_ROLE=TRAINER for a "
                               "trainer ('flotilla launch' sets it for each process)", code="E801")

    pservers_text = _get(env, "PADDLE_PSERVERS_IP_PORT_LIST")
    pservers = parse_endpoint_list(pservers_text, "PADDLE_PSERVERS_IP_PORT_LIST") if pservers_text else ()
    trainer_eps_text = _get(env, "PADDLE_TRAINER_ENDPOINTS")
    trainer_eps = parse_endpoint_list(trainer_eps_text, "PADDLE_TRAINER_ENDPOINTS") if trainer_eps_text else ()

    trainers = _get_int(env, "PADDLE_TRAINERS_NUM", 1, "the number of trainers, at least 1")
    if trainers is None:
        trainers = len(trainer_eps) or 1
    if trainer_eps and len(trainer_eps) != trainers:
        raise LaunchError(f"PADDLE_TRAINER_ENDPOINTS={trainer_eps_text!r} lists {len(trainer_eps)} endpoint(s) but "
                          f"PADDLE_TRAINERS_NUM={trainers}: expected one endpoint per trainer",
                          hint="make PADDLE_TRAINERS_NUM the number of endpoints in PADDLE_TRAINER_ENDPOINTS",
                          code="E805")

    trainer_id = _get_int(env, "PADDLE_TRAINER_ID", 0, f"a trainer id in 0..{trainers - 1}")
    if trainer_id is None:
        trainer_id = 0
    if trainer_id >= trainers:
        raise LaunchError(f"PADDLE_TRAINER_ID={trainer_id} is out of range: PADDLE_TRAINERS_NUM={trainers} allows "
                          f"0..{trainers - 1}",
                          hint="number trainers from 0, or raise PADDLE_TRAINERS_NUM", code="E802")

    if role == PSERVER:
        current = _pserver_endpoint(env, pservers, pservers_text)
    else:
        current = _trainer_endpoint(env, trainer_eps, trainer_id)
    return Role(role=role, trainer_id=trainer_id, trainers=trainers, pserver_endpoints=pservers,
                current_endpoint=current, trainer_endpoints=trainer_eps)


def _pserver_endpoint(env: Mapping[str, str], pservers: Sequence[str], pservers_text: str | None) -> str:
    """A pserver's own endpoint: ``PADDLE_CURRENT_ENDPOINT``, else ``POD_IP:PADDLE_PORT``; it must be listed."""
    if not pservers:
        raise LaunchError("TRAINING_ROLE=PSERVER but PADDLE_PSERVERS_IP_PORT_LIST is not set: a pserver needs the "
                          "list of every pserver endpoint",
                          hint="set PADDLE_PSERVERS_IP_PORT_LIST=host:port,host:port (or start the job with "
                               "'flotilla launch --server_num N --worker_num M')", code="E804")
    current_text = _get(env, "PADDLE_CURRENT_ENDPOINT")
    if current_text is not None:
        source = f"PADDLE_CURRENT_ENDPOINT={current_text!r}"
        current = format_endpoint(*parse_endpoint(current_text, "PADDLE_CURRENT_ENDPOINT"))
    else:
        pod_ip, port_text = _get(env, "POD_IP"), _get(env, "PADDLE_PORT")
        if pod_ip is None or port_text is None:
            missing = " and ".join(n for n, v in (("POD_IP", pod_ip), ("PADDLE_PORT", port_text)) if v is None)
            raise LaunchError(f"TRAINING_ROLE=PSERVER but its own endpoint is unknown: PADDLE_CURRENT_ENDPOINT is "
                              f"not set, and neither is {missing}",
                              hint="set PADDLE_CURRENT_ENDPOINT=host:port (one of PADDLE_PSERVERS_IP_PORT_LIST), "
                                   "or POD_IP and PADDLE_PORT", code="E804")
        source = f"POD_IP={pod_ip!r} with PADDLE_PORT={port_text!r}"
        current = format_endpoint(*parse_endpoint(f"{pod_ip}:{port_text}", "POD_IP:PADDLE_PORT"))
    if current not in pservers:
        raise LaunchError(f"this pserver's endpoint {current} (from {source}) is not in "
                          f"PADDLE_PSERVERS_IP_PORT_LIST={pservers_text!r}",
                          hint="a pserver must serve one of the listed endpoints: fix the list or the current "
                               "endpoint", code="E804")
    return current


def _trainer_endpoint(env: Mapping[str, str], trainer_eps: Sequence[str], trainer_id: int) -> str:
    """A trainer's own endpoint: its entry in ``PADDLE_TRAINER_ENDPOINTS``, else ``PADDLE_CURRENT_ENDPOINT``."""
    current_text = _get(env, "PADDLE_CURRENT_ENDPOINT")
    current = format_endpoint(*parse_endpoint(current_text, "PADDLE_CURRENT_ENDPOINT")) if current_text else ""
    if not trainer_eps:
        return current
    listed = trainer_eps[trainer_id]
    if current and current != listed:
        raise LaunchError(f"PADDLE_CURRENT_ENDPOINT={current_text!r} differs from entry {trainer_id} of "
                          f"PADDLE_TRAINER_ENDPOINTS ({listed}) for PADDLE_TRAINER_ID={trainer_id}",
                          hint="a trainer's current endpoint is its own entry of PADDLE_TRAINER_ENDPOINTS: fix one "
                               "of them, or unset PADDLE_CURRENT_ENDPOINT", code="E805")
    return listed


# --- roles from MPI and Slurm --------------------------------------------------------------------------

#: Paddle's variables that describe a job: with any of them set, the scheduler's variables are not read.
PADDLE_JOB_VARS = ("TRAINING_ROLE", "PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM", "PADDLE_TRAINER_ENDPOINTS",
                   "PADDLE_PSERVERS_IP_PORT_LIST")
COORDINATOR_ENV = "FLOTILLA_COORDINATOR"
DEFAULT_COORDINATOR_PORT = 6170
#: (rank, size, local size) variables of each launcher that starts a collective job without Flotilla's.
SCHEDULERS = (
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MPICH", "PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS"),
    ("Slurm", "SLURM_PROCID", "SLURM_NTASKS", None),
)


def scheduler_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """Paddle's variables for a collective trainer started by ``mpirun``/``mpiexec`` (Open MPI, MPICH) or
    ``srun`` (Slurm), from their variables; None when none of them started this process.

    Trainer id and count are the scheduler's rank and size. Trainer r's endpoint is ``host:P+r`` where P is
    the coordinator's port: the coordinator (trainer 0's endpoint, the group's rendezvous) is
    ``FLOTILLA_COORDINATOR=host:port``, else torchrun's ``MASTER_ADDR``/``MASTER_PORT``, else (Slurm) the
    first node of ``SLURM_STEP_NODELIST`` on port 6170, else (every rank on this host) 127.0.0.1:6170.
    Slurm places rank r on its node by ``SLURM_STEP_TASKS_PER_NODE`` (block distribution, srun's
    default); an MPI job spanning hosts must name its coordinator, and a rank's own host is then the
    address this host reaches the coordinator from (ranks on other hosts are listed at the coordinator's
    host: only the coordinator's entry and a rank's own are used)."""
    for name, rank_var, size_var, local_size_var in SCHEDULERS:
        if _get(env, rank_var) is None:
            continue
        size = _get_int(env, size_var, 1, f"the number of {name} ranks")
        if size is None:
            raise LaunchError(f"{rank_var} is set but {size_var} is not: cannot tell the number of trainers",
                              hint=f"start the job with {name}'s launcher, which sets both", code="E806")
        rank = _get_int(env, rank_var, 0, f"a {name} rank below {size_var}={size}")
        assert rank is not None
        if rank >= size:
            raise LaunchError(f"{rank_var}={rank} is out of range for {size_var}={size}", code="E806")
        if name == "Slurm":
            nodes = expand_hostlist(_get(env, "SLURM_STEP_NODELIST") or _get(env, "SLURM_JOB_NODELIST") or "")
            hosts = _slurm_task_hosts(env, nodes, size)
            coordinator = _coordinator(env, hosts[0] if hosts else None)
        else:
            local_size = _get_int(env, local_size_var, 1, f"the number of {name} ranks on this host")
            spans = local_size is not None and local_size < size
            coordinator = _coordinator(env, None if spans else "127.0.0.1", f"{name} job spanning hosts")
            hosts = [coordinator[0]] * size
            if spans:
                hosts[rank] = _address_towards(coordinator[0])
        host, port = coordinator
        if port + size - 1 > 65535:
            raise LaunchError(f"the coordinator's port {port} leaves no room for {size} trainer ports", code="E806")
        endpoints = [format_endpoint(hosts[r], port + r) for r in range(size)]
        endpoints[0] = format_endpoint(host, port)
        return {"TRAINING_ROLE": TRAINER, "PADDLE_TRAINER_ID": str(rank), "PADDLE_TRAINERS_NUM": str(size),
                "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints)}
    return None


def _coordinator(env: Mapping[str, str], default_host: str | None, needs: str = "") -> tuple[str, int]:
    text = _get(env, COORDINATOR_ENV)
    if text is not None:
        return parse_endpoint(text, COORDINATOR_ENV)
    master = _get(env, "MASTER_ADDR")
    port = _get_int(env, "MASTER_PORT", 1, "the coordinator's port")
    host = master or default_host
    if host is None:
        raise LaunchError(f"a {needs} needs its coordinator: set {COORDINATOR_ENV}=host:port (the first rank's host "
                          "and a free port there) on every rank", hint=f"e.g. mpirun -x {COORDINATOR_ENV}=10.0.0.1:6170 "
                          "... (Open MPI) or mpiexec -genv ... (MPICH)", code="E806")
    return parse_endpoint(f"{host}:{port or DEFAULT_COORDINATOR_PORT}", "MASTER_ADDR:MASTER_PORT")


def _address_towards(host: str) -> str:
    """This host's address on the route to ``host`` (a UDP socket's connect sends nothing)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((host, 9))
        except OSError as e:
            raise LaunchError(f"no route from this host to the coordinator {host}: {e.strerror or e}",
                              code="E806") from None
        return sock.getsockname()[0]


def _slurm_task_hosts(env: Mapping[str, str], nodes: list[str], size: int) -> list[str]:
    """Each rank's node under srun's block distribution (``SLURM_STEP_TASKS_PER_NODE``: ``2(x3),1``)."""
    if not nodes:
        return []
    text = _get(env, "SLURM_STEP_TASKS_PER_NODE") or _get(env, "SLURM_TASKS_PER_NODE")
    counts: list[int] = []
    for item in (text.split(",") if text else []):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            raise LaunchError(f"SLURM_STEP_TASKS_PER_NODE={text!r} is not a task count list such as 2(x3),1",
                              code="E806")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if not counts:  # no counts given: spread the ranks evenly, as srun's block distribution does
        per, extra = divmod(size, len(nodes))
        counts = [per + (i < extra) for i in range(len(nodes))]
    if len(counts) != len(nodes) or sum(counts) != size:
        raise LaunchError(f"SLURM_STEP_TASKS_PER_NODE={text!r} does not place {size} task(s) on the {len(nodes)} "
                          f"node(s) of the node list", code="E806")
    return [node for node, count in zip(nodes, counts) for _ in range(count)]


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list → hosts, in order: ``node[01-03,07],gpu-a[1-2]`` → node01, node02,
    node03, node07, gpu-a1, gpu-a2 (zero padding kept; several bracket groups expand as a product)."""
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        if not item:
            raise LaunchError(f"host list {text!r} has an empty item", code="E806")
        hosts += _expand_one(item, text)
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, current = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if depth < 0 or depth > 1:
            raise LaunchError(f"host list {text!r} has unbalanced or nested brackets", code="E806")
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    if depth:
        raise LaunchError(f"host list {text!r} has an unclosed bracket", code="E806")
    return [*items, current] if text else []


def _expand_one(item: str, text: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if match is None:
        return [item]
    prefix, suffix = item[:match.start()], item[match.end():]
    out = []
    for part in match.group(1).split(","):
        bounds = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if bounds is None or (bounds.group(2) and int(bounds.group(2)) < int(bounds.group(1))):
            raise LaunchError(f"host list {text!r}: {part!r} is not a number or a range lo-hi", code="E806")
        lo, hi = bounds.group(1), bounds.group(2) or bounds.group(1)
        width = len(lo)
        for n in range(int(lo), int(hi) + 1):
            out += _expand_one(f"{prefix}{n:0{width}d}{suffix}", text)
    return out
