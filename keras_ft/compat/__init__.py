"""Every use of Keras, TensorFlow, JAX and CPython internals, in one place.

Keras changes its private code every release. Each use of a private name is
a named function here, with the public-API fallback it has; `registry.py`
checks once what this installation offers and warns once, naming what is
lost, for each capability it cannot use. No other module of keras-ft
touches a private Keras name or walks stack frames.
"""

from keras_ft.compat.building import planned_variables
from keras_ft.compat.data import (
    ArrayView,
    PyDatasetView,
    TfDataState,
    advance_stream,
    fit_epoch_iterator,
    fit_tf_dataset,
    input_kind,
    is_placeholder,
    loads_in_processes,
    restore_tf_iterator,
    start_data_at_epoch,
    stream_position,
)
from keras_ft.compat.grain_input import GrainView
from keras_ft.compat.jax_cluster import gather_ints
from keras_ft.compat.multi_worker import (
    CHECKED_KERAS_VERSIONS,
    install_multi_worker_fixes,
    install_multi_worker_fixes_if_needed,
    keras_version,
    strategy_cluster,
)
from keras_ft.compat.registry import (
    DISABLE_ENV,
    available,
    disabled,
    fail,
    names,
    probe,
    usable,
)
from keras_ft.compat.saving import (
    load_with_keras_walk,
    raise_loading_failure,
    record_saveables,
    tensorflow_left_unimported,
)
from keras_ft.compat.training import (
    build_metrics,
    calling_callback_list,
    count_checkpoint_batch,
    current_frame,
    keras_global_seed_state,
    live_trainable_values,
    main_thread_frame,
    print_msg,
    private_counters,
    read_events,
    set_initial_epoch,
    set_keras_global_seed_state,
    set_tensorboard_batches,
    stack_holds,
    step_after,
    swap_ema,
    swapped_in,
    tensorboard_batches,
    tensorboard_dirs,
    tf_dataset_reshuffles,
    tf_op_determinism,
    write_restart,
)

__all__ = [
    "ArrayView",
    "CHECKED_KERAS_VERSIONS",
    "DISABLE_ENV",
    "GrainView",
    "PyDatasetView",
    "TfDataState",
    "advance_stream",
    "stream_position",
    "available",
    "build_metrics",
    "calling_callback_list",
    "count_checkpoint_batch",
    "private_counters",
    "read_events",
    "set_tensorboard_batches",
    "tensorboard_batches",
    "tensorboard_dirs",
    "write_restart",
    "swap_ema",
    "swapped_in",
    "current_frame",
    "main_thread_frame",
    "disabled",
    "fail",
    "fit_epoch_iterator",
    "fit_tf_dataset",
    "gather_ints",
    "input_kind",
    "is_placeholder",
    "loads_in_processes",
    "install_multi_worker_fixes",
    "install_multi_worker_fixes_if_needed",
    "keras_global_seed_state",
    "keras_version",
    "live_trainable_values",
    "load_with_keras_walk",
    "names",
    "planned_variables",
    "print_msg",
    "probe",
    "raise_loading_failure",
    "restore_tf_iterator",
    "record_saveables",
    "set_initial_epoch",
    "set_keras_global_seed_state",
    "stack_holds",
    "step_after",
    "tensorflow_left_unimported",
    "start_data_at_epoch",
    "strategy_cluster",
    "tf_dataset_reshuffles",
    "tf_op_determinism",
    "usable",
]
