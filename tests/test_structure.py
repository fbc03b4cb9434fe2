"""The repository's structure: what the layout promises beyond behaviour.

Pickles made before GradScaler and the adapters were split into modules still load.
"""

import base64
import pickle

import unified_amp as amp

# pickle.dumps(amp.GradScaler(init_scale=1024.0, growth_interval=7)) after
# set_backoff_factor(0.25), made by the code before the split (commit 5721bb4), where
# the torch adapter's scaler class was unified_amp.backends.torch_backend.TorchGradScaler
# and the core's unified_amp.scaler.GradScaler.
_PICKLED_BEFORE_THE_SPLIT = {
    "torch": (
        'gASVDwIAAAAAAACMInVuaWZpZWRfYW1wLmJhY2tlbmRzLnRvcmNoX2JhY2tlbmSUjA9Ub3JjaEdyYWRTY2FsZXKU'
        'k5QpgZR9lCiMCF9iYWNrZW5klE6MCF9lbmFibGVklIiMB19kZXZpY2WUTowOX3Byb2Nlc3NfZ3JvdXCUTowMX3Nj'
        'YWxlX3ZhbHVllEdAkAAAAAAAAIwOX2dyb3d0aF9mYWN0b3KUR0AAAAAAAAAAjA9fYmFja29mZl9mYWN0b3KURz/Q'
        'AAAAAAAAjBBfZ3Jvd3RoX2ludGVydmFslEsHjAhfdHJhY2tlcpRLAIwGX3N0ZXBzlEsAjA5fc2tpcHBlZF9zdGVw'
        'c5RLAIwSX2xhc3Rfc3RlcF9za2lwcGVklImMC19hc19vZl9zdGVwlEsAjARfZGV2lE6MB19sZWRnZXKUjBN1bmlm'
        'aWVkX2FtcC5fbGVkZ2VylIwKR3JhZExlZGdlcpSTlCmBlH2UKIwIX3JlY29yZHOUfZSMBWVwb2NolEsAjAlpdGVy'
        'YXRpb26USwB1YowUX3VwZGF0ZWRfYnlfYmFja3dhcmSUiYwKX2ZvcmVuc2ljc5ROjAVfdGFpbJR9lIwLX29wdF9z'
        'dGF0ZXOUfZSMB19jaGVja3OUXZSMD19oYW5kZWRfd2F0Y2hlZJSJjA1faGFuZGVkX2JsaW5klImMDV9zYXdfYmFj'
        'a3dhcmSUiXViLg=='
    ),
    "megengine": (
        'gASV+gEAAAAAAACMEnVuaWZpZWRfYW1wLnNjYWxlcpSMCkdyYWRTY2FsZXKUk5QpgZR9lCiMCF9iYWNrZW5klE6M'
        'CF9lbmFibGVklIiMB19kZXZpY2WUTowOX3Byb2Nlc3NfZ3JvdXCUTowMX3NjYWxlX3ZhbHVllEdAkAAAAAAAAIwO'
        'X2dyb3d0aF9mYWN0b3KUR0AAAAAAAAAAjA9fYmFja29mZl9mYWN0b3KURz/QAAAAAAAAjBBfZ3Jvd3RoX2ludGVy'
        'dmFslEsHjAhfdHJhY2tlcpRLAIwGX3N0ZXBzlEsAjA5fc2tpcHBlZF9zdGVwc5RLAIwSX2xhc3Rfc3RlcF9za2lw'
        'cGVklImMC19hc19vZl9zdGVwlEsAjARfZGV2lE6MB19sZWRnZXKUjBN1bmlmaWVkX2FtcC5fbGVkZ2VylIwKR3Jh'
        'ZExlZGdlcpSTlCmBlH2UKIwIX3JlY29yZHOUfZSMBWVwb2NolEsAjAlpdGVyYXRpb26USwB1YowUX3VwZGF0ZWRf'
        'YnlfYmFja3dhcmSUiYwKX2ZvcmVuc2ljc5ROjAVfdGFpbJR9lIwLX29wdF9zdGF0ZXOUfZSMB19jaGVja3OUXZSM'
        'D19oYW5kZWRfd2F0Y2hlZJSJjA1faGFuZGVkX2JsaW5klImMDV9zYXdfYmFja3dhcmSUiXViLg=='
    ),
}


def test_a_scaler_pickled_before_the_split_loads_with_its_settings():
    backend = amp.get_backend().name
    scaler = pickle.loads(base64.b64decode(_PICKLED_BEFORE_THE_SPLIT[backend]))
    assert type(scaler) is type(amp.GradScaler())  # the same class the backend makes now
    assert isinstance(scaler, amp.GradScaler)
    assert scaler.state_dict() == {"scale": 1024.0, "growth_factor": 2.0,
                                   "backoff_factor": 0.25, "growth_interval": 7,
                                   "_growth_tracker": 0}
    # And a new pickle names the class by the same path, so the old code loads it too.
    again = pickle.dumps(scaler)
    module = type(scaler).__module__.encode()
    assert module in again and type(scaler).__name__.encode() in again
    assert module in base64.b64decode(_PICKLED_BEFORE_THE_SPLIT[backend])
