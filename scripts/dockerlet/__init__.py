"""A kubelet and a Deployment controller on a Docker engine: pods started from rendered manifests.

No Kubernetes API server can be installed on these machines, so the container smoke
(scripts/container_smoke.py) starts the pods of `make k8s-render-kind` itself, as a kubelet would: every
pod of every Deployment from its pod template, one Docker container per pod (init containers run to
completion first), on one Docker network; and a RayCluster's pods as the KubeRay operator would build them.

    manifests.py  the rendered objects, indexed, and the file under k8s/ each one comes from
    podspec.py    a pod template to the arguments of `docker create` (pure: unit-tested without Docker);
                  any field it does not implement is one line naming the manifest, the object and the field
    preflight.py  what a schema cannot see, checked before anything starts: `python -m MODULE` names a
                  module the image has, `NAME:PORT` names a Service, a path in a command or the job's
                  entrypoint lies in a volume that provides it
    kuberay.py    a RayCluster's head and worker groups as Deployments whose templates are what KubeRay
                  v1.7.0 makes of them (the generated `ray start`, env, labels, init container, head Service)
    probes.py     the probe state machine (initial delay, period, thresholds; pure)
    runtime.py    containers on Docker: start, probes on their period, restarts (restartPolicy Always,
                  a failing liveness probe), deletion as Kubernetes does it (preStop, SIGTERM, SIGKILL
                  after terminationGracePeriodSeconds), a deleted pod replaced from the same template

What Kubernetes does that this cannot (say so wherever a result is reported): scheduling (every pod is
on this one host; requests only weight CPU time, nodeSelector/tolerations/affinity are refused),
NetworkPolicy enforcement (not applied: the pods reach each other and nothing else, as the smoke's
network has no route out), the device plugin (no GPUs), ClusterIPs (a Service's name resolves straight
to its pods' IPs through Docker's DNS; its environment variables, enableServiceLinks, are not set), and
emptyDir volumes surviving a container restart (they are tmpfs mounts of their sizeLimit here, new on
every start).
"""
