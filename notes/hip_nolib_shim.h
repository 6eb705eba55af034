// Definitions for the few device-library (ockl / opencl) symbols that the
// HIP 5.2 headers in /usr/include/hip reference, so that code using
// threadIdx/blockIdx/blockDim/gridDim/__syncthreads/__threadfence links with
// -nogpulib. Include AFTER <hip/hip_runtime.h>, in exactly one TU.
#pragma once
extern "C" __device__ size_t __ockl_get_local_id(uint d) {
  return d == 0 ? __builtin_amdgcn_workitem_id_x()
       : d == 1 ? __builtin_amdgcn_workitem_id_y() : __builtin_amdgcn_workitem_id_z();
}
extern "C" __device__ size_t __ockl_get_group_id(uint d) {
  return d == 0 ? __builtin_amdgcn_workgroup_id_x()
       : d == 1 ? __builtin_amdgcn_workgroup_id_y() : __builtin_amdgcn_workgroup_id_z();
}
extern "C" __device__ size_t __ockl_get_local_size(uint d) {
  return d == 0 ? __builtin_amdgcn_workgroup_size_x()
       : d == 1 ? __builtin_amdgcn_workgroup_size_y() : __builtin_amdgcn_workgroup_size_z();
}
extern "C" __device__ size_t __ockl_get_num_groups(uint d) {
  unsigned g = d == 0 ? __builtin_amdgcn_grid_size_x()
             : d == 1 ? __builtin_amdgcn_grid_size_y() : __builtin_amdgcn_grid_size_z();
  unsigned w = __ockl_get_local_size(d);
  return (g + w - 1) / w;
}
extern "C" __device__ void __atomic_work_item_fence(__cl_mem_fence_flags, __memory_order o, __memory_scope s) {
#define HIPSHIM_FENCE(SC) \
  if (o == __memory_order_acquire) __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, SC); \
  else if (o == __memory_order_release) __builtin_amdgcn_fence(__ATOMIC_RELEASE, SC); \
  else if (o == __memory_order_acq_rel) __builtin_amdgcn_fence(__ATOMIC_ACQ_REL, SC); \
  else if (o == __memory_order_seq_cst) __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, SC);
  if (s == __memory_scope_work_group) { HIPSHIM_FENCE("workgroup") }
  else if (s == __memory_scope_device) { HIPSHIM_FENCE("agent") }
  else if (s == __memory_scope_work_item || s == __memory_scope_sub_group) { HIPSHIM_FENCE("wavefront") }
  else { HIPSHIM_FENCE("") }
#undef HIPSHIM_FENCE
}
