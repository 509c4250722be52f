"""FedBuff (``mode = "fedbuff"``): asynchronous buffered aggregation for whole-model
training (Nguyen et al. 2022): the coordinator half (`coordinator`), the device half
(`device`), the server buffer's update rule (`buffer`) and the options (`options`)."""
