# A stand-in for the Platform SDK's Python runtime (qaicrt) for tests without a card: it loads a QPC written by
# tests/fake_qaic/qaic-compile (programqpc.bin names the ONNX graph and its specializations) and runs that graph on
# ONNX Runtime the way the card runs the QPC: buffers bound by index, the IO descriptor sized for the first
# specialization, a call's buffer dimensions pick the specialization (none matches: the run fails), the past_* and
# *_RetainedState buffers must be skipped and the KV cache stays inside (retained state; float32 here, float16 on the
# card, so that the text can be compared with PyTorch's).
import json
import os

import numpy as np
import onnxruntime as ort

import QAicApi_pb2 as api

DTYPES = {api.FLOAT_TYPE: np.float32, api.FLOAT_16_TYPE: np.float16, api.INT64_I_TYPE: np.int64}


class QStatus:
    QS_SUCCESS, QS_ERROR = 0, 1


def QIDList(ids):
    return list(ids)


def BufferDimensionsVecRef(dims):
    return list(dims)


class Context:
    def __init__(self, ids):
        self.ids = ids


class QAicProgramProperties:
    dataPathTimeoutMs, devMapping = 0, ""


class QBuffer:
    def __init__(self, data):
        self.data = bytes(data)
        self.size = len(self.data)


class Qpc:
    def __init__(self, path):
        with open(os.path.join(path, "programqpc.bin")) as f:
            info = json.load(f)
        self.session = ort.InferenceSession(info["onnx"], providers=["CPUExecutionProvider"])
        self.specs = [{k: int(v) for k, v in s.items()} for s in info["specializations"]]
        self.bindings = []
        for direction, values in ((api.BUFFER_IO_TYPE_INPUT, self.session.get_inputs()),
                                  (api.BUFFER_IO_TYPE_OUTPUT, self.session.get_outputs())):
            for v in values:
                kind = (api.INT64_I_TYPE if v.type == "tensor(int64)" else
                        api.FLOAT_16_TYPE if v.name.startswith("past_") else api.FLOAT_TYPE)
                dims = [d if isinstance(d, int) else self.specs[0].get(d, 1) for d in v.shape]
                self.bindings.append(dict(name=v.name, index=len(self.bindings), dir=direction, type=kind, dims=dims,
                                          size=int(np.prod(dims)) * np.dtype(DTYPES[kind]).itemsize))

    def getIoDescriptor(self):
        return QStatus.QS_SUCCESS, json.dumps(self.bindings).encode()


class Program:
    def __init__(self, context, device, qpc, props):
        self.qpc, self.loaded = qpc, False

    def load(self):
        self.loaded = True
        return QStatus.QS_SUCCESS

    def activate(self):
        return QStatus.QS_SUCCESS


class Queue:
    def __init__(self, context, device):
        pass

    def enqueue(self, exec_obj):
        return exec_obj.run()


class ExecObj:
    def __init__(self, context, program):
        assert program.loaded
        self.qpc, self.kv, self.status, self.out = program.qpc, {}, QStatus.QS_ERROR, []

    def setData(self, buffers, dims):
        self.buffers, self.dims = list(buffers), list(dims)
        return QStatus.QS_SUCCESS

    def run(self):
        feed, b = {}, {x["name"]: x for x in self.qpc.bindings}
        for x in self.qpc.bindings:
            buf, (_, shape) = self.buffers[x["index"]], self.dims[x["index"]]
            if x["name"].startswith("past_") or x["name"].endswith("_RetainedState"):
                assert buf.size == 0, f"{x['name']} must be skipped (retained state)"
            elif x["dir"] == api.BUFFER_IO_TYPE_INPUT:
                feed[x["name"]] = np.frombuffer(buf.data, DTYPES[x["type"]]).reshape(shape)
        rows, seq = feed["input_ids"].shape
        if not any(s["batch_size"] == rows and s["seq_len"] == seq for s in self.qpc.specs):
            self.status = QStatus.QS_ERROR  # no specialization for these buffers
            return QStatus.QS_SUCCESS
        if not self.kv:
            spec = self.qpc.specs[-1]
            n = spec.get("full_batch_size", spec["batch_size"])
            for name in (k for k in b if k.startswith("past_") and not k.endswith("_RetainedState")):
                _, heads, _, dim = self.qpc.session.get_inputs()[b[name]["index"]].shape
                self.kv[name] = np.zeros((n, heads, spec["ctx_len"], dim), np.float32)
        out = self.qpc.session.run(None, {**feed, **self.kv})
        names = [o.name for o in self.qpc.session.get_outputs()]
        for name, value in zip(names, out):
            if name.endswith("_RetainedState"):
                self.kv[name[:-len("_RetainedState")]] = value
        logits = out[names.index("logits")]
        assert tuple(self.dims[b["logits"]["index"]][1]) == logits.shape, "logits buffer of the wrong batch"
        self.out = [buf.data for buf in self.buffers]
        self.out[b["logits"]["index"]] = logits.astype(np.float32).tobytes()
        self.status = QStatus.QS_SUCCESS
        return QStatus.QS_SUCCESS

    def waitForCompletion(self):
        return self.status

    def getData(self):
        return QStatus.QS_SUCCESS, self.out
