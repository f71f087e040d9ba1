# Element-wise reduction kernels: out = a op b over n elements, nogil.
cdef int reduce_into(void* out, const void* a, const void* b, size_t n,
                     int dtype, int op) noexcept nogil
cdef void divide_by(void* buf, size_t n, int dtype, double divisor) noexcept nogil
cdef int check_op(int dtype, int op, str where) except -1
cdef int dtype_itemsize(int dtype) noexcept nogil
