"""Launchers: how a rank's process comes to be (alone, torchrun, Slurm, Ray Train) and the one seam
they share: the process group, the network interface, where snapshots go and where notices come from."""
