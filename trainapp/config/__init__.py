"""Run configuration: dataclass sections (one module per subsystem), a YAML file and `section.key=value`
overrides, loaded by trainapp/config/load.py. The names below are what the rest of trainapp uses."""

from trainapp.config.faults import DrillSection, FaultSection, PreemptSection
from trainapp.config.launch import DistSection, NetworkSection, ParallelSection, RaySection
from trainapp.config.load import Config, from_dict, leaves, load, parse_override, read_yaml
from trainapp.config.run import (
                                 BUILTIN_TASKS,
                                 IMPORT_PATH,
                                 AmpSection,
                                 DataSection,
                                 InitSection,
                                 ModelSection,
                                 ObserveSection,
                                 OptimSection,
                                 RunSection,
                                 SchedSection,
                                 SnapshotSection,
                                 TaskSection,
                                 TrainSection,
)
from trainapp.errors import ConfigError

__all__ = ["BUILTIN_TASKS", "IMPORT_PATH", "AmpSection", "Config", "ConfigError", "DataSection",
           "InitSection", "DistSection", "ParallelSection", "DrillSection", "FaultSection", "ModelSection",
           "NetworkSection", "ObserveSection", "OptimSection", "PreemptSection", "RaySection",
           "RunSection", "SchedSection", "SnapshotSection", "TaskSection", "TrainSection", "from_dict",
           "leaves", "load", "parse_override", "read_yaml"]
