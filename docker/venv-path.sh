# /etc/profile.d/trainapp-venv.sh (from docker/venv-path.sh): login shells (`bash -l`, as KubeRay
# starts `ray start`) reset PATH in /etc/profile; put the image's venv first again so `ray`,
# `python` and `torchrun` are the venv's.
case ":${PATH}:" in
    *:/opt/venv/bin:*) ;;
    *) PATH="/opt/venv/bin:${PATH}" ;;
esac
export PATH
