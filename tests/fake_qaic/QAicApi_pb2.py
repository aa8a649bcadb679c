# A stand-in for the Platform SDK's QAicApi_pb2 (tests/fake_qaic/qaicrt.py's IO descriptor): the enum values
# qaic_backends reads and an IoDesc whose ParseFromString takes the fake QPC's JSON descriptor.
import json
from types import SimpleNamespace

FLOAT_TYPE, FLOAT_16_TYPE, INT64_I_TYPE, INT32_I_TYPE, INT8_Q_TYPE = 0, 1, 2, 3, 4
BUFFER_IO_TYPE_INPUT, BUFFER_IO_TYPE_OUTPUT = 0, 1


class IoDesc:
    def ParseFromString(self, data: bytes):
        self.selected_set = SimpleNamespace(bindings=[SimpleNamespace(**b) for b in json.loads(data)])
