"""Can this Keras train at all, without keras-ft? (.ci/compat asks first.)"""

import keras
import numpy as np

model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile("adam", "mse")
model.fit(np.ones((8, 4)), np.ones((8, 2)), epochs=1, verbose=0)
model.evaluate(np.ones((8, 4)), np.ones((8, 2)), verbose=0)
